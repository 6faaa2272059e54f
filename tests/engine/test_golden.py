"""The golden runs: seeded runs of every way in (ULS, ELS, FedAvg, LoRA, make_private, the HF
PrivateTrainer and a 2-process FSDP run) give the models, ledgers and privacy records recorded in
tests/engine/golden_runs.json. They are the engine's behaviour, fixed before it is recomposed
into parts: a change of shape must not move them.

What is compared, and how exactly:

* the privacy record (``PrivacyRecord.to_dict()``, the engine's part of privacy.json) and the
  ledger's figures: exactly, field by field, less the fields that name a machine or a version
  (``VOLATILE``) and the journal's random run id (its line count is kept);
* each parameter tensor: its sum, its L2 norm and its inner product with a fixed random vector, to
  1e-6 relative (a change of cohort or of noise moves them by far more; a reordered sum moves
  them by ~1e-7), and the SHA-256 of all the parameters' bytes: bit for bit where the run is on
  the platform the file was recorded on (torch version, CPU, threads), since float arithmetic on
  another CPU may round differently.

Record anew (after a change that moves the numbers on purpose, said in its commit):
``PYTHONPATH=tests python tests/engine/test_golden.py --record``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys

import numpy as np
import pytest
import torch
from _hf_helpers import hf_args, hf_dataset, hf_model
from _paths import TESTS

from userdp.engine import (
    ELS,
    SGD,
    ULS,
    Adam,
    FedAvg,
    FlatClip,
    RunOptions,
    TensorUserData,
    TrainConfig,
    make_private,
    train,
)

from _engine_helpers import MLP, ce_loss, mlp_data, run_gloo_pair, train_config

GOLDEN = TESTS / "engine" / "golden_runs.json"
#: record fields that name the machine or the library versions, not the run
VOLATILE = {"noise_kernel", "libraries", "versions", "created", "hostname"}
SIZES = [3, 1, 4, 2, 5, 2, 1, 3, 2, 4, 1, 2]


def _platform() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu": cpu, "threads": torch.get_num_threads()}


def _summary(named: dict[str, np.ndarray]) -> dict:
    digest = hashlib.sha256()
    tensors, sizes = {}, {}
    for name in sorted(named):
        a = np.ascontiguousarray(named[name])
        digest.update(name.encode() + a.tobytes())
        flat = a.astype(np.float64).ravel()
        probe = np.random.default_rng(len(name)).standard_normal(flat.size)
        tensors[name] = [float(flat.sum()), float(np.linalg.norm(flat)), float(flat @ probe)]
        sizes[name] = flat.size
    return {"sha256": digest.hexdigest(), "tensors": tensors, "sizes": sizes}


def _close(got: list, want: list, size: int) -> bool:
    """Whether a tensor's figures (sum, L2 norm, inner product with a fixed normal probe) agree to
    1e-6 of their scale: a sum or an inner product over n numbers of norm r is rounded on the scale
    of sqrt(n)·r (a reordered sum moves it by ~1e-7 of that), not on the scale of its value, which
    cancellation may bring near 0; a norm on the scale of r."""
    r = max(abs(want[1]), 1e-12)
    scale = [np.sqrt(size) * r, r, np.sqrt(size) * r]
    return all(abs(g - w) <= 1e-6 * s for g, w, s in zip(got, want, scale, strict=True))


def _params(model) -> dict[str, np.ndarray]:
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}


def _record(rec) -> dict:
    d = json.loads(json.dumps(rec.to_dict() if hasattr(rec, "to_dict") else rec, default=str))
    if d.get("journal"):  # its run id is random by design (and the hash chain's head with it)
        d["journal"] = {"lines": d["journal"]["lines"]}
    return {k: v for k, v in d.items() if k not in VOLATILE}


def _config(algorithm, **kw) -> TrainConfig:
    base = dict(
        algorithm=algorithm,
        steps=3,
        clipping=FlatClip(0.5),
        optimizer=SGD(lr=0.2),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=11,
        chunk_size=2,
        accountant="rdp",
    )
    return train_config(**{**base, **kw})


def _tokens(seed=3) -> TensorUserData:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (sum(SIZES), 10), generator=g)
    return TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.concatenate([[0], np.cumsum(SIZES)]))


def _tiny_gpt2():
    from userdp.lm import models

    torch.manual_seed(0)
    return models.build_preset("tiny", vocab_size=64, n_positions=32).train()


# ------------------------------------------------------------------------------------ the runs
def run_engine(algorithm: str) -> dict:
    torch.manual_seed(0)
    model = MLP()
    alg = {"uls": ULS(2, 0.5), "els": ELS(2, 0.4), "fedavg": FedAvg(2, 0.5, local_epochs=2, local_lr=0.1)}[algorithm]
    res = train(model, mlp_data(SIZES), ce_loss, _config(alg))
    return {"params": _summary(_params(model)), "record": _record(res.record), "epsilon": res.epsilon}


def run_lora() -> dict:
    from peft import LoraConfig, get_peft_model

    from userdp.lm.models import causal_lm_loss

    model = get_peft_model(_tiny_gpt2(), LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0))
    res = train(model, _tokens(), causal_lm_loss, _config(ULS(2, 0.5), optimizer=Adam(lr=1e-2)))
    return {"params": _summary(_params(model)), "record": _record(res.record), "epsilon": res.epsilon}


def run_make_private() -> dict:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    private = make_private(model, optimizer, mlp_data(SIZES), ce_loss, _config(ULS(2, 0.5)))
    for step in private:
        optimizer.zero_grad()
        step.backward()
        optimizer.step()
    return {"params": _summary(_params(model)), "record": _record(private.record()), "epsilon": private.epsilon()}


def run_trainer(tmp_path) -> dict:
    from userdp.hf import PrivateTrainer

    privacy = _config(ULS(group_size=2, sampling_rate=0.3), steps=4)
    privacy = train_config(**{**privacy.__dict__, "chunk_size": 8})
    trainer = PrivateTrainer(
        model=hf_model(), args=hf_args(tmp_path), train_dataset=hf_dataset(), privacy=privacy, user_field="user"
    )
    trainer.train()
    written = json.loads((tmp_path / "out" / "privacy.json").read_text())
    return {
        "params": _summary(_params(trainer.model)),
        "record": _record(written["engine_record"]),
        "epsilon": written["engine_record"]["epsilon"],
    }


def _sharded_rank(rank: int) -> dict:
    from torch.distributed.tensor import DTensor

    from userdp.engine.distributed.processes import TorchDistributedCombiner
    from userdp.lm.models import causal_lm_loss

    model = _tiny_gpt2()
    cfg = _config(ULS(2, 0.5), optimizer=Adam(lr=1e-2), sharding="fsdp")
    res = train(model, _tokens(), causal_lm_loss, cfg, RunOptions(combiner=TorchDistributedCombiner()))
    full = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().numpy().copy()
        for n, p in model.named_parameters()
    }
    return {"params": _summary(full), "record": _record(res.record), "epsilon": res.epsilon}


def run_sharded() -> dict:
    results = run_gloo_pair(_sharded_rank)
    assert results[0]["params"]["sha256"] == results[1]["params"]["sha256"]  # one model, two ranks
    return results[0]


RUNS = {
    "uls": functools.partial(run_engine, "uls"),
    "els": functools.partial(run_engine, "els"),
    "fedavg": functools.partial(run_engine, "fedavg"),
    "lora": run_lora,
    "make_private": run_make_private,
    "trainer": run_trainer,
    "sharded_fsdp_2_ranks": run_sharded,
}


def _run(name: str, tmp_path) -> dict:
    return RUNS[name](tmp_path) if name == "trainer" else RUNS[name]()


# ------------------------------------------------------------------------------------ the test
# the sharded run's property in one process: a distribution in one file gives the replicated sum
SHARDED_COUNTERPART = (
    "tests/engine/test_distribution.py::test_a_distribution_in_one_file_releases_the_replicated_runs_sum"
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow, pytest.mark.heavy(counterpart=SHARDED_COUNTERPART)])
        if n.startswith("sharded")
        else n
        for n in sorted(RUNS)
    ],
)
def test_a_seeded_run_gives_the_recorded_model_ledger_and_record(name, tmp_path):
    if name == "sharded_fsdp_2_ranks" and not torch.distributed.is_available():
        pytest.skip("needs torch.distributed (gloo)")
    golden = json.loads(GOLDEN.read_text())
    want, got = golden["runs"][name], _run(name, tmp_path)
    assert got["epsilon"] == want["epsilon"]
    assert got["record"] == want["record"]
    assert set(got["params"]["tensors"]) == set(want["params"]["tensors"])
    for tensor, figures in want["params"]["tensors"].items():
        assert _close(got["params"]["tensors"][tensor], figures, got["params"]["sizes"][tensor]), tensor
    if _platform() == golden["platform"]:
        assert got["params"]["sha256"] == want["params"]["sha256"], "not bit for bit on the recording platform"


def test_the_summary_tells_apart_models_that_differ_in_one_weight():
    a = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, dtype=np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    b["w"][2, 1] += 1e-3
    sa, sb = _summary(a), _summary(b)
    assert sa["sha256"] != sb["sha256"]
    assert sa["tensors"]["b"] == sb["tensors"]["b"]
    assert not _close(sa["tensors"]["w"], sb["tensors"]["w"], 12)
    assert _close(sa["tensors"]["b"], sb["tensors"]["b"], 4)


def _record_all() -> None:
    import tempfile
    from pathlib import Path

    runs = {}
    for name in sorted(RUNS):
        with tempfile.TemporaryDirectory() as d:
            runs[name] = _run(name, Path(d))
        print(f"recorded {name}: {runs[name]['params']['sha256'][:16]}", file=sys.stderr)
    GOLDEN.write_text(json.dumps({"platform": _platform(), "runs": runs}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: PYTHONPATH=tests python tests/engine/test_golden.py --record")
    torch.set_num_threads(1)  # as the suite's workers run (tests/conftest.py)
    _record_all()

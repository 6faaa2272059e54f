"""Step time of the DP engine (ULS, ELS) against a non-private step on the same model and
records, and against Opacus's per-sample-gradient DP-SGD step (the ELS comparison), all
measured in this run. Models: a tiny GPT-2 (2 layers, 128 wide, eager attention, loss masked
by labels == -100, no attention_mask) and an MLP.

    python benchmarks/bench_engine.py          # full
    python benchmarks/bench_engine.py --quick  # reduced, a smoke check

Every step processes the same number of records B = M*G: ULS = M users x G records,
ELS = B record-units, non-private = one batch of B records, Opacus = one batch of B records.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings

import numpy as np
import torch
from torch import nn

from userdp.engine import ELS, SGD, ULS, FlatClip, TensorUserData, TrainConfig
from userdp.engine.performance import Performance
from userdp.engine.run.step import EngineRun

logging.getLogger("absl").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")


# ------------------------------------------------------------------ models and data
def gpt2_setup(num_users, recs_per_user, seq_len, vocab=4096):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        vocab_size=vocab,
        n_positions=seq_len,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "eager"
    rng = np.random.default_rng(0)
    n = num_users * recs_per_user
    ids = torch.from_numpy(rng.integers(0, vocab, (n, seq_len)))
    lens = rng.integers(seq_len // 2, seq_len + 1, n)
    labels = ids.clone()
    for i, l in enumerate(lens):
        labels[i, l:] = -100  # right padding: masked in the loss, no attention_mask needed
    data = TensorUserData({"input_ids": ids, "labels": labels}, np.arange(0, n + 1, recs_per_user))

    def loss_fn(m, batch):
        ids = batch["input_ids"]
        # explicit per-record position ids: Opacus's embedding grad sampler needs the batch dim
        pos = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
        logits = m(input_ids=ids, position_ids=pos).logits[:, :-1]
        lab = batch["labels"][:, 1:]
        tok = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), lab.reshape(-1).clamp(min=0), reduction="none"
        ).view(lab.shape)
        mask = (lab != -100).to(tok.dtype)
        return (tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)

    return model, data, loss_fn


class MLP(nn.Module):
    def __init__(self, d_in=256, h=512, d_out=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d_out))

    def forward(self, x):
        return self.net(x)


def mlp_setup(num_users, recs_per_user):
    torch.manual_seed(0)
    model = MLP()
    rng = np.random.default_rng(0)
    n = num_users * recs_per_user
    x = torch.from_numpy(rng.normal(size=(n, 256))).float()
    y = torch.from_numpy(rng.integers(0, 10, n))
    data = TensorUserData({"x": x, "y": y}, np.arange(0, n + 1, recs_per_user))

    def loss_fn(m, batch):
        return nn.functional.cross_entropy(m(batch["x"]), batch["y"], reduction="none")

    return model, data, loss_fn


# ------------------------------------------------------------------ timed steps
def _random_batch(data, sizes, B, rng):
    """B records drawn uniformly over users, then within the user (the baselines' batches)."""
    users = rng.integers(0, data.num_users, B)
    recs = (rng.random(B) * sizes[users]).astype(np.int64)
    return data.gather(users, recs)


def nonprivate_step(model, data, loss_fn, B, rng):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sizes = data.sizes()

    def step():
        batch = _random_batch(data, sizes, B, rng)
        opt.zero_grad()
        loss_fn(model, batch).mean().backward()
        opt.step()

    return step


def engine_step(model, data, loss_fn, algo, chunk):
    # a constant number of units per step, so step times compare (Poisson varies the cohort;
    # the per-unit cost is the same). ELS with G > 1 has no fixed-size accountant: "shuffle".
    sampling, acc = ("shuffle", "pld") if isinstance(algo, ELS) else ("fixed_size", "rdp")
    cfg = TrainConfig(
        algorithm=algo,
        steps=10**6,
        clipping=FlatClip(1.0),
        optimizer=SGD(1e-3),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        sampling=sampling,
        accountant=acc,
        performance=Performance(chunk_size=chunk, track_epsilon=False),
    )
    run = EngineRun(model, data, loss_fn, cfg)
    return run.run_step


def opacus_step(model, data, loss_fn, B, rng):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B
    )
    sizes = data.sizes()

    def step():
        batch = _random_batch(data, sizes, B, rng)
        opt.zero_grad()
        loss_fn(gsm, batch).mean().backward()
        opt.step()

    return step


def bench(name, setup, M, G, chunk, warmup, reps, with_opacus):
    """Build every step, then time them round-robin (one step of each in turn, ``reps`` rounds)
    so that load from other processes hits all of them alike; report medians."""
    B = M * G
    rng = np.random.default_rng(1)
    steps = {}
    model, data, loss_fn = setup()
    nparams = sum(p.numel() for p in model.parameters())
    n_users, n_rec = data.num_users, int(data.sizes().sum())
    steps["non-private (batched backward)"] = nonprivate_step(model, data, loss_fn, B, rng)
    model, data, loss_fn = setup()
    steps[f"ULS ({M} users x G={G})"] = engine_step(model, data, loss_fn, ULS(G, M / n_users), chunk)
    model, data, loss_fn = setup()
    steps[f"ELS ({B} record units, G={G})"] = engine_step(model, data, loss_fn, ELS(G, B / n_rec), chunk)
    if with_opacus:
        model, data, loss_fn = setup()
        try:
            steps["Opacus DP-SGD (per-sample grads)"] = opacus_step(model, data, loss_fn, B, rng)
            steps["Opacus DP-SGD (per-sample grads)"]()
        except Exception as exc:  # report, do not hide
            print(f"  Opacus failed on {name}: {type(exc).__name__}: {exc}")
            steps.pop("Opacus DP-SGD (per-sample grads)", None)
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    rows = {k: statistics.median(v) for k, v in times.items()}
    base = rows["non-private (batched backward)"]
    print(
        f"\n{name}: {nparams / 1e6:.2f}M parameters, {B} records per step, chunk {chunk}, "
        f"median of {reps} round-robin steps"
    )
    print(f"  {'step':40s} {'s/step':>8s} {'x non-private':>14s}")
    for k, v in rows.items():
        print(f"  {k:40s} {v:8.4f} {v / base:14.2f}")
    if "Opacus DP-SGD (per-sample grads)" in rows:
        o = rows["Opacus DP-SGD (per-sample grads)"]
        els = [v for k, v in rows.items() if k.startswith("ELS")][0]
        print(f"  ELS / Opacus = {els / o:.2f}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: steadier figures on a shared machine)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        M, G, T, reps, warm = 8, 4, 32, 5, 1
    else:
        M, G, T, reps, warm = 32, 4, 64, 15, 2
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bench("MLP 256-512-512-10", lambda: mlp_setup(4 * M, 2 * G), M, G, 64, warm, reps, True)
    bench(f"GPT-2 2x128 (vocab 4096, {T} tokens)", lambda: gpt2_setup(4 * M, 2 * G, T), M, G, 32, warm, reps, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

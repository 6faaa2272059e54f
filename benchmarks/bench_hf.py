"""The cost of running userdp inside a Hugging Face Trainer (issue 38): the same private run driven by
``userdp.hf.PrivateTrainer`` and by ``make_private`` in a plain loop (the engine's own step, as
``userdp train`` runs it), and a plain non-private ``Trainer`` step over the same number of records,
all measured in this run, each in its own process (its peak memory its own).

    python benchmarks/bench_hf.py            # a small GPT-2, ULS G = 4, ~20 users a step; ~2 min on 2 cores
    python benchmarks/bench_hf.py --json
    python benchmarks/bench_hf.py --quick     # a smoke check (benchmarks/run.py --quick)
    python benchmarks/bench_hf.py --modes nonprivate_sft,private_sft   # TRL's SFTTrainer, both sides

Time per step is the median over the timed steps of a run, then over ``--repeat`` interleaved runs (the first, warm-up step excluded); peak memory is
the process's peak resident set over the timed steps (Linux VmHWM after a reset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

from bench_scale import _peak_rss, _reset_peak_rss  # noqa: E402  (this folder's: peak RSS since a reset)

from userdp.engine import RunOptions

MODES = ("nonprivate_trainer", "engine_train", "own_loop", "private_trainer", "nonprivate_sft", "private_sft")


def _worker(mode: str, a) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from userdp.engine import SGD, ULS, FlatClip, TrainConfig, make_private, train
    from userdp.engine.performance import Performance
    from userdp.hf import PrivateTrainer, UserRecords
    from userdp.lm.models import causal_lm_loss

    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    n = a.users * a.records
    ds = Dataset.from_dict(
        {
            "input_ids": [[int(t) for t in rng.integers(1, 500, a.seq_len)] for _ in range(n)],
            "user": [f"u{i % a.users}" for i in range(n)],
        }
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=512,
            n_positions=a.seq_len,
            n_embd=a.width,
            n_layer=a.layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    rate = a.cohort / a.users
    privacy = TrainConfig(
        algorithm=ULS(group_size=a.records, sampling_rate=rate),
        steps=a.steps,
        clipping=FlatClip(1.0),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        performance=Performance(track_epsilon=False),
    )
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            if state.global_step == 1:
                _reset_peak_rss()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    out = tempfile.mkdtemp(prefix="bench-hf-")
    args = TrainingArguments(
        output_dir=out,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        optim="sgd",
        learning_rate=0.01,
        lr_scheduler_type="constant",
        disable_tqdm=True,
        logging_steps=10**6,
        max_grad_norm=0.0,
        max_steps=a.steps,
        per_device_train_batch_size=a.cohort * a.records,
        dataloader_drop_last=True,
    )
    if mode == "nonprivate_trainer":  # the same records a step: cohort x G rows

        def collate(rows):
            ids = torch.tensor([r["input_ids"] for r in rows])
            return {"input_ids": ids, "labels": ids.clone()}

        t = Trainer(
            model=model,
            args=args,
            train_dataset=ds.remove_columns(["user"]),
            data_collator=collate,
            callbacks=[Clock()],
        )
        t.train()
    elif mode == "private_trainer":
        t = PrivateTrainer(
            model=model, args=args, train_dataset=ds, privacy=privacy, user_field="user", callbacks=[Clock()]
        )
        t.train()
    elif mode == "engine_train":  # the loop `userdp train` hands its RunPlan to: engine.train
        last = [time.perf_counter()]

        def tick(metrics):
            now = time.perf_counter()
            times.append(now - last[0])
            if len(times) == 1:
                _reset_peak_rss()
            last[0] = now

        train(
            model,
            UserRecords(ds, "user"),
            causal_lm_loss,
            dataclasses.replace(privacy, optimizer=SGD(0.01)),
            RunOptions(callbacks=[tick]),
        )
    elif mode in ("nonprivate_sft", "private_sft"):  # TRL's SFTTrainer, its defaults kept (gradient checkpointing)
        _sft(mode, model, ds, privacy, args, Clock())
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with make_private(model, opt, UserRecords(ds, "user"), causal_lm_loss, privacy) as private:
            for step in private:
                t0 = time.perf_counter()
                if step.index == 2:
                    _reset_peak_rss()
                opt.zero_grad()
                step.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
    timed = times[1:]
    return {"mode": mode, "s_per_step": statistics.median(timed), "steps_timed": len(timed), "peak_bytes": _peak_rss()}


def _sft(mode: str, model, ds, privacy, args, clock) -> None:
    """A TRL ``SFTTrainer`` step (non-private, over the same records a step) or a
    ``PrivateSFTTrainer`` one, on the pre-tokenized rows (TRL tokenizes nothing), with a word-level
    tokenizer of the model's vocabulary and the Trainer rows' settings (bf16 off on both sides)."""
    import trl
    from tokenizers import Tokenizer
    from tokenizers import models as tm
    from transformers import PreTrainedTokenizerFast

    from userdp.hf_trl import PrivateSFTTrainer

    vocab = {f"w{i}": i for i in range(512)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tm.WordLevel(vocab, unk_token="w0")), eos_token="w1", unk_token="w0", pad_token="w0"
    )
    keep = {
        k: getattr(args, k)
        for k in (
            "output_dir",
            "report_to",
            "save_strategy",
            "use_cpu",
            "optim",
            "learning_rate",
            "lr_scheduler_type",
            "disable_tqdm",
            "logging_steps",
            "max_grad_norm",
            "max_steps",
            "per_device_train_batch_size",
            "dataloader_drop_last",
        )
    }
    cfg = trl.SFTConfig(**keep, bf16=False, max_length=None)
    if mode == "nonprivate_sft":
        trl.SFTTrainer(
            model=model, args=cfg, train_dataset=ds.remove_columns(["user"]), processing_class=tok, callbacks=[clock]
        ).train()
    else:
        PrivateSFTTrainer(
            model=model,
            args=cfg,
            train_dataset=ds,
            processing_class=tok,
            privacy=privacy,
            user_field="user",
            callbacks=[clock],
        ).train()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--records", type=int, default=4, help="records per user = G")
    ap.add_argument("--cohort", type=int, default=20, help="expected users per step")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions of the three modes (median)")
    ap.add_argument("--quick", action="store_true", help="a smoke check: 4 steps, one repetition")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--modes", default=",".join(MODES[:4]), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.repeat = 4, 1
    if a.worker:
        print(json.dumps(_worker(a.worker, a)))
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: comma-separated, of {', '.join(MODES)} (got {a.modes!r})")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    worker_argv = [
        f"--{k.replace('_', '-')}={getattr(a, k)}"
        for k in ("users", "records", "cohort", "seq_len", "width", "layers", "steps", "threads")
    ]
    for _ in range(max(1, a.repeat)):  # interleaved: every mode once a round
        for mode in modes:
            res = subprocess.run(
                [sys.executable, __file__, "--worker", mode, *worker_argv], capture_output=True, text=True
            )
            try:
                runs[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
            except (IndexError, json.JSONDecodeError):
                runs[mode].append({"mode": mode, "error": (res.stderr.strip().splitlines() or ["no output"])[-1][:300]})
    rows = {}
    for mode, rs in runs.items():
        ok = [r for r in rs if "s_per_step" in r]
        if not ok:
            rows[mode] = rs[-1]
            continue
        rows[mode] = {
            "mode": mode,
            "s_per_step": statistics.median(r["s_per_step"] for r in ok),
            "s_per_step_min": min(r["s_per_step"] for r in ok),
            "s_per_step_max": max(r["s_per_step"] for r in ok),
            "peak_bytes": statistics.median(r["peak_bytes"] for r in ok),
            "repeats": len(ok),
        }
    _ratios(rows)
    if a.json:
        print(json.dumps(list(rows.values())))
        return 0
    _print(rows, a)
    return 0


def _ratios(rows: dict) -> None:
    """Each private entry point's time and peak memory against its baselines, where both ran."""

    def ok(*names):
        return all(n in rows and "s_per_step" in rows[n] for n in names)

    if ok("private_sft", "nonprivate_sft"):
        sft, plain_sft = rows["private_sft"], rows["nonprivate_sft"]
        sft["time_vs_nonprivate_sft"] = sft["s_per_step"] / plain_sft["s_per_step"]
        sft["memory_vs_nonprivate_sft"] = sft["peak_bytes"] / plain_sft["peak_bytes"]
    if not ok("own_loop", "private_trainer", "nonprivate_trainer", "engine_train"):
        return
    own, hf, plain, eng = rows["own_loop"], rows["private_trainer"], rows["nonprivate_trainer"], rows["engine_train"]
    hf["time_vs_engine_train"] = hf["s_per_step"] / eng["s_per_step"]
    hf["memory_vs_engine_train"] = hf["peak_bytes"] / eng["peak_bytes"]
    hf["time_vs_own_loop"] = hf["s_per_step"] / own["s_per_step"]
    hf["memory_vs_own_loop"] = hf["peak_bytes"] / own["peak_bytes"]
    hf["time_vs_nonprivate_trainer"] = hf["s_per_step"] / plain["s_per_step"]
    hf["memory_vs_nonprivate_trainer"] = hf["peak_bytes"] / plain["peak_bytes"]


def _print(rows: dict, a) -> None:
    hf = rows.get("private_trainer", {})
    for r in rows.values():
        if "error" in r:
            print(f"{r['mode']:20s} error: {r['error']}")
        else:
            print(
                f"{r['mode']:20s} {r['s_per_step']:.3f} s/step [{r['s_per_step_min']:.3f}-{r['s_per_step_max']:.3f}]  "
                f"peak {r['peak_bytes'] / 2**20:.0f} MiB"
            )
    if "time_vs_nonprivate_sft" in rows.get("private_sft", {}):
        sft = rows["private_sft"]
        print(
            f"PrivateSFTTrainer vs a non-private SFTTrainer step over the same records: "
            f"{sft['time_vs_nonprivate_sft']:.2f}x time, {sft['memory_vs_nonprivate_sft']:.2f}x memory"
        )
    if "time_vs_engine_train" in hf:
        print(
            f"PrivateTrainer vs engine.train (the loop `userdp train` runs): {hf['time_vs_engine_train']:.2f}x time, "
            f"{hf['memory_vs_engine_train']:.2f}x peak memory"
        )
    if "time_vs_own_loop" in hf:
        print(
            f"PrivateTrainer vs make_private's own loop: {hf['time_vs_own_loop']:.2f}x time, "
            f"{hf['memory_vs_own_loop']:.2f}x peak memory; vs a non-private Trainer step over the same records: "
            f"{hf['time_vs_nonprivate_trainer']:.2f}x time, {hf['memory_vs_nonprivate_trainer']:.2f}x memory"
        )
    print(
        f"{a.users} users x {a.records} records of {a.seq_len} tokens, ~{a.cohort} users a step (ULS G = "
        f"{a.records}), GPT-2 {a.layers} layers x {a.width}; {a.threads} torch thread(s); median of {a.repeat} "
        "interleaved repetitions [min-max]"
    )


if __name__ == "__main__":
    sys.exit(main())

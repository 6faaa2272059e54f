"""What the rounded tensor-core operand costs the clip factor (issue 35): a ghost chunk's flat clip
bound over its norm estimate, per unit, with the exact ``[hi | lo]`` operand and with the rounded
one (``contraction.SUM_OPERAND``), on the CPU with the tensor-core arithmetic emulated (bf16 autocast).

The clip factor divides by the bound, so a bound 1% above the estimate clips an honest unit 1%
harder than its norm asks. The rounded operand (the default on tensor cores) halves the clipped
sum's FLOPs on a GPU; this is the other side of that trade. The time side: ``bench_traffic.py``
counts it, and the GPU check's ``uls:split`` row measures it.

    python benchmarks/bench_operand.py                                   # a random-weight tiny GPT-2
    python benchmarks/bench_operand.py --model DIR --store DIR           # a local model over a userdp store

``--model``: a local Hugging Face GPT-2 folder with its ``tokenizer.json`` (e.g. one of
``userdp cache info``'s pretrained presets); ``--store``: a userdp record store (``records.arrow``
with a ``text`` column and the users' ``offsets.npy``), whose first users with G x L tokens make the
units.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import userdp.engine.contraction as contraction  # noqa: E402
from userdp.engine.algorithms import ULS  # noqa: E402
from userdp.engine.clipping import FlatClip, StepClipping  # noqa: E402
from userdp.engine.ghost import bound as ghost_bound  # noqa: E402
from userdp.engine.ghost import strategy as ghost_strategy  # noqa: E402
from userdp.engine.precision import Precision  # noqa: E402
from userdp.lm import models  # noqa: E402


def _units_from_store(model_dir: Path, store: Path, users: int, group: int, seq: int) -> torch.Tensor:
    import pyarrow as pa
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with pa.memory_map(str(store / "records.arrow")) as f:
        texts = pa.ipc.open_file(f).read_all().column("text").to_pylist()
    offsets = np.load(store / "offsets.npy")
    units = []
    for u in range(len(offsets) - 1):
        ids = tok.encode(" ".join(texts[offsets[u] : offsets[u + 1]])).ids
        if len(ids) >= group * seq:
            units.append(torch.tensor(ids[: group * seq]).view(group, seq))
        if len(units) == users:
            break
    if len(units) < users:
        raise SystemExit(f"--store: only {len(units)} users hold {group} x {seq} tokens; lower --users")
    return torch.stack(units)


def bound_over_estimate(model: torch.nn.Module, ids: torch.Tensor, operand: str) -> torch.Tensor:
    """``[m]``: each unit's flat clip bound over its flat norm estimate, one ghost chunk, bf16 autocast,
    tensor cores emulated, the clipped sum's operand ``operand``."""
    seen = {}
    real = ghost_bound.bounded_norms

    def spy(parts, m):
        seen["est"], seen["up"] = real(parts, m)
        return seen["est"], seen["up"]

    m, g, _ = ids.shape
    saved = contraction.TENSOR_CORES, contraction.SUM_OPERAND, ghost_bound.bounded_norms
    contraction.TENSOR_CORES, contraction.SUM_OPERAND, ghost_bound.bounded_norms = "on", operand, spy
    try:
        ghost_strategy.GhostPerUnit(model, models.causal_lm_loss, ULS(g, 0.5), Precision("bfloat16")).clipped_sum(
            {"input_ids": ids, "labels": ids.clone()},
            torch.ones(m, g),
            torch.ones(m),
            StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32),
        )
    finally:
        contraction.TENSOR_CORES, contraction.SUM_OPERAND, ghost_bound.bounded_norms = saved
    return (seen["up"] ** 2).sum(1).sqrt() / (seen["est"] ** 2).sum(1).sqrt()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a local GPT-2 folder (default: a random-weight tiny one)")
    p.add_argument("--store", type=Path, default=None, help="a userdp record store (with --model)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if (a.model is None) != (a.store is None):
        p.error("--model and --store go together")
    if a.model is None:
        torch.manual_seed(0)
        model, what = models.build_preset("tiny", vocab_size=1001, n_positions=max(64, a.seq_len)), "random tiny GPT-2"
        ids = torch.randint(0, 1001, (a.users, a.group_size, a.seq_len), generator=torch.Generator().manual_seed(8))
    else:
        from transformers import GPT2LMHeadModel

        model, what = GPT2LMHeadModel.from_pretrained(a.model), f"{a.model.name} over {a.store.name}"
        ids = _units_from_store(a.model, a.store, a.users, a.group_size, a.seq_len)
    model.train()
    row = {"model": what, "users": a.users, "group_size": a.group_size, "seq_len": a.seq_len}
    for operand in ("split", "rounded"):
        r = bound_over_estimate(model, ids, operand)
        row[operand] = {"median": float(r.median()), "min": float(r.min()), "max": float(r.max())}
    if a.json:
        print(json.dumps(row))
    else:
        for operand in ("split", "rounded"):
            q = row[operand]
            print(
                f"{what}, ULS G = {a.group_size} x {a.seq_len} tokens, {operand} operand: flat bound / estimate "
                f"{q['median']:.4f} [{q['min']:.4f}-{q['max']:.4f}]"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

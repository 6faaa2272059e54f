"""Device ops per DP chunk against a non-private forward + backward of the same records (issue 27).

On a GPU each op is a kernel launch (plus its Python dispatch): a ghost chunk that dispatches
several times a non-private step's ops is launch-bound at small batches whatever its FLOPs. The
count is exact and machine-independent, so it is taken on the ``meta`` device (no data, no
arithmetic) under a dispatch mode that counts every aten op; views (view, transpose, permute,
expand, ...) launch no kernel and are counted apart.

    python benchmarks/bench_ops.py            # tiny preset and gpt2-small
    python benchmarks/bench_ops.py --quick    # tiny preset only
    python benchmarks/bench_ops.py --users 64 --tokens 64   # a GPU-sized chunk (16,384 tokens)

Prints, per model: the ghost chunk's ops (ULS, G = 4, by default 8 users x 4 records x 16 tokens,
flat clipping), the non-private forward + backward's over the same 32 records, and their ratio; the
per-op excess names where the rest goes.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from userdp.engine.clipping import StepClipping

#: aten ops that only make a new view of storage: no kernel launches
VIEW_OPS = frozenset(
    {
        "view.default",
        "_unsafe_view.default",
        "reshape.default",
        "transpose.int",
        "permute.default",
        "t.default",
        "expand.default",
        "unsqueeze.default",
        "squeeze.dim",
        "squeeze.dims",
        "squeeze.default",
        "select.int",
        "slice.Tensor",
        "as_strided.default",
        "detach.default",
        "alias.default",
        "split.Tensor",
        "unbind.int",
        "split_with_sizes.default",
        "diagonal.default",
        "unflatten.int",
        "view_as.default",
        "narrow.default",
        "view.dtype",
    }
)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name; a scalar read of a meta tensor gets a harmless answer."""

    def __init__(self):
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count[func.__name__] += 1
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 0
        return func(*args, **kwargs)

    def kernels(self) -> int:
        return sum(v for n, v in self.count.items() if n not in VIEW_OPS)


def chunk_ops(preset: str, *, users: int = 8, records: int = 4, tokens: int = 16, vocab: int = 512) -> dict:
    """Ops of one ghost ULS chunk and of a non-private forward + backward of the same records."""
    from userdp.engine import ULS
    from userdp.engine.clipping import FlatClip
    from userdp.engine.per_unit import make_per_unit
    from userdp.engine.user_data import TensorUserData
    from userdp.lm import models

    torch.manual_seed(0)
    model = models.build_preset(preset, vocab, max(tokens, 64)).to("meta")
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (users * records, tokens)))
    data = TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.arange(0, users * records + 1, records))
    batch, mask = data.draw_records(np.arange(users), records, np.random.default_rng(0))
    batch = {n: v.to("meta") for n, v in batch.items()}
    mask = mask.to("meta").float()
    per_unit = make_per_unit("ghost", model, models.causal_lm_loss, ULS(records, 0.5))
    clip = FlatClip(1.0)
    for _ in range(2):  # the first chunk carries the strategy's one-time check of its hooks
        dp = OpCounter()
        with dp:
            per_unit.clipped_sum(
                batch, mask, torch.ones(users, device="meta"), StepClipping(clip, clip.initial_state(), torch.float32)
            )
    flat = {n: v.reshape(users * records, *v.shape[2:]) for n, v in batch.items()}
    plain = OpCounter()
    with plain:
        models.causal_lm_loss(model, flat).mean().backward()
    excess = collections.Counter({n: dp.count[n] - plain.count.get(n, 0) for n in dp.count if n not in VIEW_OPS})
    return {
        "model": preset,
        "trainable_tensors": sum(p.requires_grad for p in model.parameters()),
        "dp_chunk_ops": sum(dp.count.values()),
        "nonprivate_ops": sum(plain.count.values()),
        "dp_chunk_kernels": dp.kernels(),
        "nonprivate_kernels": plain.kernels(),
        "kernel_ratio": dp.kernels() / plain.kernels(),
        "excess": dict(excess.most_common(8)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny preset only")
    ap.add_argument("--users", type=int, default=8, help="units in the chunk (default 8)")
    ap.add_argument("--records", type=int, default=4, help="records a unit, G (default 4)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens a record (default 16)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [
        chunk_ops(p, users=args.users, records=args.records, tokens=args.tokens)
        for p in (("tiny",) if args.quick else ("tiny", "gpt2-small"))
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        print(
            f"{r['model']:>10}: {r['trainable_tensors']} tensors; ghost chunk {r['dp_chunk_kernels']} kernels "
            f"({r['dp_chunk_ops']} ops with views) vs non-private forward+backward {r['nonprivate_kernels']} "
            f"({r['nonprivate_ops']}): {r['kernel_ratio']:.2f}x"
        )
        print(f"{'':>12}excess by op: {r['excess']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

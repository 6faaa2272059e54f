"""Peak memory of a ghost chunk against a non-private forward and backward of the same records,
counted op by op without a GPU: the memory side of issue 35's check, read on a CPU in seconds.

How. The model and the batch are fake tensors (``FakeTensorMode``: shapes, dtypes and storages,
no data), run under bf16 autocast with float32 weights, as a GPU run is, and with the ghost
strategy's device path (the tensor-core contractions, aligned rows, the bad units always zeroed:
:func:`device_path`). :class:`LiveBytes` counts the bytes of each storage an op makes, from the op
until the storage is freed (a weak reference's finalizer), and keeps the peak with the op and the
frames it was reached at, overall and inside the norm phase (``parameter_norm2`` and the stacks' ``norm2``).
The weights, made before, are counted on neither side.

What it is not: a CUDA run. CPU autocast's op lists stand in for CUDA's (both cast the GEMMs and
attention to bf16; userdp upcasts the logits itself), the clipped sums' ``[hi | lo]`` operand takes
torch's passes (a float32 product more than CUDA's Triton kernel, in the sum phase), and there is
no allocator (no caching, no fragmentation) and no optimizer. Stop 51's H100 read 1.28x / 1.31x
the non-private step's peak (gpt2-small / gpt2-medium, the whole step); this count read 1.23x /
1.25x on that code (benchmarks/README.md).

    python benchmarks/bench_memory.py                      # gpt2-small and gpt2-medium, 64 users x G = 4 x 64 tokens
    python benchmarks/bench_memory.py --models gpt2-small --users 8 --json
    python benchmarks/bench_memory.py --lora 8 --algorithms uls    # LoRA r = 8 (real weights, fake activations)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
import weakref
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import userdp.engine.contraction as contraction  # noqa: E402
from userdp.engine.algorithms import ELS, ULS  # noqa: E402
from userdp.engine.clipping import FlatClip, StepClipping  # noqa: E402
from userdp.engine.ghost import GhostPerUnit  # noqa: E402
from userdp.engine.ghost import factors as ghost_factors  # noqa: E402
from userdp.engine.precision import Precision  # noqa: E402
from userdp.lm.models import causal_lm_loss  # noqa: E402

GiB = 2**30
SHAPES = {
    "gpt2-small": dict(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),
}
#: the frames whose ops count as the norm phase
NORM_PHASE = ("parameter_norm2", "norm2")


class LiveBytes(TorchDispatchMode):
    """Live storage bytes made under the mode: ``peak``, the ``(op, frames)`` it was reached at
    (``at``), and the same inside the norm phase (``norm_peak``, ``norm_at``). A storage is counted
    once, however many tensors view it, until it is freed."""

    def __init__(self, frames: tuple[str, ...] = ("ghost.py",)):
        super().__init__()
        self._seen = WeakIdKeyDictionary()
        self.live = self.peak = self.norm_peak = 0
        self.at = self.norm_at = None
        self._frames = frames

    def _drop(self, n: int) -> None:
        self.live -= n

    def _where(self, stack) -> list[str]:
        return [f"{f.name}:{f.lineno}" for f in stack if any(w in f.filename for w in self._frames)][-4:]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s not in self._seen:
                    self._seen[s] = True
                    n = s.nbytes()
                    self.live += n
                    weakref.finalize(s, self._drop, n)
        if self.live > self.peak or self.live > self.norm_peak:
            stack = traceback.extract_stack()
            if self.live > self.peak:
                self.peak, self.at = self.live, (str(func), self._where(stack))
            if self.live > self.norm_peak and any(f.name in NORM_PHASE for f in stack):
                self.norm_peak, self.norm_at = self.live, (str(func), self._where(stack))
        return out


@contextlib.contextmanager
def device_path():
    """Fake CPU tensors take the ghost strategy's device path: tensor-core contractions (aten
    ``mm``/``bmm`` with a float32 ``out_dtype``, whose fake kernels need no data), aligned rows, and
    the bad units' rows zeroed as on a device (which never reads whether any unit is bad): always,
    or never where the step zeroes lazily (``StepClipping.lazy_zeroing``, as the loop runs it)."""
    with (
        mock.patch.object(contraction, "TC_DEVICES", (*contraction.TC_DEVICES, "cpu")),
        mock.patch.object(contraction, "must_zero", lambda bad, lazy=False: not lazy),
        mock.patch.dict(ghost_factors._COEFFICIENTS, clear=True),
    ):  # its tensors belong to one fake mode
        yield


def _gpt2(vocab: int, positions: int, shape: dict) -> torch.nn.Module:
    """A float32 GPT-2 of ``shape`` (n_embd, n_layer, n_head) in training mode, made on whatever
    device or fake mode is current."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, bos_token_id=vocab - 1, eos_token_id=vocab - 1, **shape)
    return GPT2LMHeadModel(cfg).train()


def fake_gpt2(mode: FakeTensorMode, vocab: int = 50257, positions: int = 1024, **shape) -> torch.nn.Module:
    """A float32 GPT-2 of ``shape`` made of fake tensors."""
    with mode:
        return _gpt2(vocab, positions, shape)


def lora_gpt2(rank: int, vocab: int = 50257, positions: int = 1024, **shape) -> torch.nn.Module:
    """A float32 GPT-2 of ``shape`` with LoRA adapters of ``rank`` (userdp's own LoRA setup), its weights
    real CPU tensors: peft's module moves do not run on fake tensors, so the LoRA rows take real
    weights (not counted, as the fake ones are not) and fake activations (``allow_non_fake_inputs``)."""
    from userdp.lm import models

    return models.apply_lora(_gpt2(vocab, positions, shape), models.LoraSpec(rank=rank, alpha=2.0 * rank))


def sides(model: torch.nn.Module, algorithm: str, users: int, group: int, seq: int, lazy: bool = True):
    """``(strategy, nonprivate, ghost)``: a non-private forward and backward over ``users x group``
    records of ``seq`` tokens under bf16 autocast, and one ghost chunk of the same records
    (``algorithm`` "uls": ``users`` units of ``group`` records; "els": each record a unit; its bad
    units zeroed lazily, as the loop runs it on a device, or always), as two functions to call under
    the fake mode and :func:`device_path` (their batch is made when they are called)."""
    records = users * group
    m, g = (users, group) if algorithm == "uls" else (records, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    algo = (ULS if algorithm == "uls" else ELS)(group_size=group, sampling_rate=0.5)
    st = GhostPerUnit(model, causal_lm_loss, algo, Precision("bfloat16"))
    st.coverage.unchecked = []  # the first chunk's coverage check (once a run) is not the step's

    def nonprivate():
        flat = torch.zeros(records, seq, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, {"input_ids": flat, "labels": flat}).mean()
        return torch.autograd.grad(loss, params)

    def ghost():
        ids = torch.zeros(m, g, seq, dtype=torch.long)
        return st.clipped_sum(
            {"input_ids": ids, "labels": ids},
            torch.ones(m, g),
            torch.ones(m),
            StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32, lazy_zeroing=lazy),
        )

    return st, nonprivate, ghost


def peaks(mode: FakeTensorMode, model: torch.nn.Module, algorithm: str, users: int, group: int, seq: int) -> dict:
    """The peak live bytes of :func:`sides`' non-private forward and backward and of its ghost chunk,
    each with where it was reached. ``model`` was made under ``mode``."""
    st, nonprivate, ghost = sides(model, algorithm, users, group, seq)
    seen = {}
    with mode, device_path():
        for side, fn in (("nonprivate", nonprivate), ("ghost", ghost)):
            live = LiveBytes()
            with live:
                result = fn()
            del result
            seen[side] = live
    a, b = seen["nonprivate"], seen["ghost"]
    return {
        "algorithm": algorithm,
        "users": users,
        "group_size": group,
        "seq_len": seq,
        "nonprivate_peak_gib": a.peak / GiB,
        "ghost_peak_gib": b.peak / GiB,
        "ghost_over_nonprivate": b.peak / a.peak,
        "ghost_peak_at": b.at,
        "ghost_norm_phase_peak_gib": b.norm_peak / GiB,
        "ghost_norm_phase_peak_at": b.norm_at,
        "narrow": all(all(v) for v in st.last_narrow.values()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--algorithms", nargs="+", default=["uls", "els"], choices=["uls", "els"])
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA adapters of rank R (real weights)")
    p.add_argument("--json", action="store_true", help="one JSON row per line")
    args = p.parse_args(argv)
    for name in args.models:
        if args.lora:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            model = lora_gpt2(args.lora, **SHAPES[name])
        else:
            mode = FakeTensorMode()
            model = fake_gpt2(mode, **SHAPES[name])
        for algorithm in args.algorithms:
            t0 = time.perf_counter()
            row = {
                "model": name,
                "lora_rank": args.lora or None,
                **peaks(mode, model, algorithm, args.users, args.group_size, args.seq_len),
            }
            row["seconds"] = round(time.perf_counter() - t0, 1)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{name} {algorithm.upper()}: non-private {row['nonprivate_peak_gib']:.2f} GiB, ghost "
                    f"{row['ghost_peak_gib']:.2f} GiB ({row['ghost_over_nonprivate']:.3f}x) at "
                    f"{row['ghost_peak_at']}; norm phase {row['ghost_norm_phase_peak_gib']:.2f} GiB at "
                    f"{row['ghost_norm_phase_peak_at']}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

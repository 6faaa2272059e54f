"""How many units fit in a chunk: a memory model of one per-unit call, and the chunk it allows.

A step's cohort is processed in chunks whose clipped sums accumulate (float32) into one buffer,
so any cohort runs within a memory cap; the chunk size is a speed knob only (it changes neither
the sampling nor the noise: the guarantee is the same for every chunk size). ``chunk_size: auto``
picks the largest power of two (the engine's bucket sizes) whose estimated peak fits the cap.

The estimate, per unit of G records × L tokens (T = G·L tokens), for a transformer with n layers,
width d, h heads, feed-forward width f and vocabulary V, in the forward's dtype (b bytes):

* activations kept for the backward: ``T · n · (17·d + f + 2.5·h·L) · b`` (Korthikanti et al. 2022's
  34·d + 5·h·L bytes per token per layer at 2 bytes, with the 4·d feed-forward made explicit);
* the logits, their float32 log-softmax, and in the backward the gradients of both (float32),
  alive together: ``T · V · (b + 12)``;
* ghost: the output gradients of every layer that owns a trainable parameter, all held until the
  clipped sum is formed, in the forward's dtype (``T · Σ d_out · b``; a layer as wide as the
  vocabulary is the logits', counted above; the layers' inputs are activations, counted above, and
  are upcast one layer at a time), and the two Gram matrices of the layer being reduced,
  ``2 · T² · 4`` (where same-shaped layers are stacked, a group's temporaries are bounded apart, a
  fixed :data:`STACK_TRANSIENT_BYTES`);
* vmap: one float32 copy of the trainable parameters' gradient per unit.

Fixed, whatever the chunk: the weights; two float32 model-sized buffers (the step's running sum
and the chunk's partial sum being added to it; the noise is streamed into the sum in 4 MB pieces
and the sum becomes the optimizer's gradient in place); on a CPU, where the host source draws a
step's noise while its sums are computed, a third (:func:`userdp.engine.noise.gaussian.draws_ahead`);
float32 master weights where the parameters are narrower; under a bf16/fp16 autocast forward,
autocast's 2 B copy of each float32 weight matrix, which autograd keeps for the backward; and the
optimizer state. The model is deliberately simple; the chosen chunk is reported, and a cap given
by the user is a cap on this estimate, which may fill 90% of it (``MODEL_MARGIN``).
``benchmarks/bench_scale.py`` measures the real peak beside it (``estimate_over_measured``): on a
CPU (peak RSS, gpt2-small, ghost, float32) 1.24–1.29 at 256 tokens a chunk and 0.99 at 2,048
(benchmarks/README.md). ``benchmarks/bench_memory.py`` counts a ghost chunk's live bytes op by op
under bf16 autocast on the device path: the estimate reads 0.95–1.05 of that count at gpt2-small
and gpt2-medium (a test holds it at or above ``MODEL_MARGIN``). On an H100, before the ghost
captures stopped holding the layers' outputs, it read 0.78–0.83 of the CUDA peak (docs/gpus.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from userdp.engine.distributed.sharding import gathered_blocks
from userdp.engine.ghost import GROUP_ELEMENTS
from userdp.engine.host import free_host_bytes
from userdp.engine.noise.gaussian import GaussianNoise, draws_ahead, source_class
from userdp.errors import UserError

MAX_AUTO_CHUNK = 256
#: ghost stacks same-shaped layers so a group's Grams and sum are one batched product each; a group's
#: temporaries are capped at GROUP_ELEMENTS elements each: its two float32 Gram stacks and the stacked
#: copy of one factor (at most 4 B an element) are alive together, 12 B an element in all
STACK_TRANSIENT_BYTES = 12 * GROUP_ELEMENTS
HEADROOM = 0.8  # of the free memory, when no cap is given
#: the share of a cap the estimate may fill: the model has measured 0.95-1.29x the real peak
#: (benchmarks/README.md), so a chunk filling the cap to the byte could overrun it by a few %
MODEL_MARGIN = 0.9


def _dims(model: nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    if cfg is None and hasattr(model, "base_model"):  # peft wrapper
        cfg = getattr(getattr(model, "base_model", None), "config", None)
    if cfg is None:
        return None

    def first(*names, default=None):
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int) and v > 0:
                return v
        return default

    d = first("hidden_size", "n_embd", "d_model")
    n = first("num_hidden_layers", "n_layer", "num_layers")
    if d is None or n is None:
        return None
    return {
        "d": d,
        "layers": n,
        "heads": first("num_attention_heads", "n_head", default=1),
        "ff": first("intermediate_size", "n_inner", default=4 * d),
        "vocab": first("vocab_size", default=0),
    }


def _ghost_widths(model: nn.Module, vocab: int) -> int:
    """Σ d_out over the layers the ghost strategy captures (those owning a trainable parameter),
    leaving out a layer whose output is the vocabulary (the logits)."""
    outs = 0
    for mod in model.modules():
        if not any(p.requires_grad for p in mod.parameters(recurse=False)):
            continue
        if isinstance(mod, nn.Linear):
            d_out = mod.out_features
        elif type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
            d_out = mod.weight.shape[1]  # transformers' Conv1D stores [in, out]
        elif isinstance(mod, nn.Embedding):
            d_out = mod.embedding_dim
        elif isinstance(mod, nn.LayerNorm):
            d_out = int(torch.Size(mod.normalized_shape).numel())
        else:  # a layer without a handler: its per-unit gradient (the fallback), not estimated here
            continue
        if vocab and d_out == vocab:
            continue
        outs += int(d_out)
    return outs


def unit_bytes(model: nn.Module, group_size: int, seq_len: int, *, strategy: str, low_precision: bool) -> int | None:
    """Estimated peak bytes one unit adds to a per-unit call (None: not a transformer config we know)."""
    dims = _dims(model)
    if dims is None:
        return None
    b = 2 if low_precision else 4
    t = group_size * seq_len
    act = t * dims["layers"] * (17 * dims["d"] + dims["ff"] + 2.5 * dims["heads"] * seq_len) * b
    logits = t * dims["vocab"] * (b + 12)
    if strategy == "vmap":
        extra = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        outs = _ghost_widths(model, dims["vocab"])
        extra = 2 * t * t * 4 + t * b * outs
        if low_precision:  # autocast runs LayerNorm in float32: the backward keeps each block's two LayerNorm
            extra += t * dims["layers"] * 2 * dims["d"] * 4  # inputs (the residual stream) in float32, not in b bytes
    return int(act + logits + extra)


def fixed_bytes(
    model: nn.Module,
    optimizer_states: int = 2,
    strategy: str = "ghost",
    *,
    noise_vectors: int = 0,
    shards: int = 1,
    low_precision: bool = False,
) -> int:
    """Bytes that do not grow with the chunk: the weights, the float32 running and partial sums,
    float32 masters of parameters narrower than float32, ``optimizer_states`` float32 states per
    trainable parameter (Adam: 2), for ghost the first chunk's batch gradient (4 B a trainable
    parameter, held while the strategy checks its hooks against autograd) and the temporaries of
    its stacked groups (:data:`STACK_TRANSIENT_BYTES`), ``noise_vectors`` model-sized float32 noise
    vectors held (4 B a trainable parameter each: the step's noise drawn while its sums
    are computed, :func:`userdp.engine.noise.gaussian.draws_ahead`, and the past vectors a correlated
    mechanism keeps across steps, BandMF's b − 1; 1/W of them on each rank of a sharded run), and with
    ``low_precision`` (a bf16/fp16 autocast
    forward) the 2 B copy of each float32 weight matrix that autocast casts for its GEMMs and
    autograd keeps for the backward (0.23 GiB at gpt2-small, 0.66 GiB at gpt2-medium; on a sharded
    rank too, for every block: autocast casts each gathered weight, and the backward keeps the cast
    after FSDP has freed the gathered float32 tensor).

    ``shards``: W of a sharded run (``sharding: fsdp``, :mod:`userdp.engine.distributed.sharding`), per rank: 1/W
    of the weights, of the running sums (which become the released gradient) and of the optimizer's
    states, plus the two largest blocks gathered whole at once (FSDP gathers the next block while one
    computes) and two copies of the largest parameter (the one whole sum a rank holds while it is
    reduce-scattered, or rank 0's noise for it while it is scattered); no stacked groups and no noise
    drawn ahead; the coverage check's batch gradient of 1/W of the parameters at a time (at least the
    largest), over the first W chunks."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    masters = sum(p.numel() for p in trainable if p.element_size() < 4)
    verify = n if strategy == "ghost" else 0
    stacks = STACK_TRANSIENT_BYTES if strategy == "ghost" else 0
    ahead = n * int(noise_vectors)
    casts = (
        2 * sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p.dtype == torch.float32)
        if low_precision
        else 0
    )
    if shards > 1:
        blocks = sorted(
            (sum(p.numel() * p.element_size() for p in b.parameters()) for b in gathered_blocks(model)), reverse=True
        )
        gathered = sum(blocks[:2]) if blocks else total  # no blocks: the root gathers everything
        largest = max((p.numel() for p in trainable), default=0)
        verify = max(math.ceil(n / shards), largest) if strategy == "ghost" else 0
        return int(
            total / shards
            + gathered
            + casts
            + 4 * (n * (1 + optimizer_states) / shards + 2 * largest + masters + verify + ahead / shards)
        )
    return int(total + casts + 4 * (n * (2 + optimizer_states) + masters + verify + ahead) + stacks)


def free_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (CUDA: the driver's figure; CPU: available physical memory)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = free_host_bytes()
    return 8 << 30 if free is None else free  # 8 GiB where the OS does not say


@dataclass(frozen=True)
class RunShape:
    """What a run's memory depends on besides the model: a unit's records (``group_size``) and
    tokens (``seq_len``), the per-unit ``strategy``, a bf16/fp16 forward (``low_precision``), the
    optimizer's float32 states per parameter, and W of a sharded run (``shards``; 1: replicated)."""

    group_size: int
    seq_len: int
    strategy: str = "ghost"
    low_precision: bool = False
    optimizer_states: int = 2
    shards: int = 1
    noise_buffers: int = 0


def auto_chunk_size(
    model: nn.Module, shape: RunShape, *, device: torch.device, memory_cap_bytes: int | None = None
) -> tuple[int, dict]:
    """The largest power-of-two chunk whose estimated peak fits the cap, and how it was chosen.

    Args:
        shape: the run's unit, strategy, precision, optimizer states and shards (:class:`RunShape`).
        memory_cap_bytes: the cap; None means 80% of the device's free memory now.

    Returns:
        (chunk_size, info) with info holding the cap, the fixed and per-unit estimates.

    Raises:
        UserError: when even one unit does not fit the cap (the message gives both figures).
    """
    group_size, seq_len, shards = shape.group_size, shape.seq_len, shape.shards
    cap = int(memory_cap_bytes) if memory_cap_bytes is not None else int(HEADROOM * free_bytes(device))
    per = unit_bytes(model, group_size, seq_len, strategy=shape.strategy, low_precision=shape.low_precision)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ahead = shards == 1 and source_class(device) is GaussianNoise and draws_ahead(n)  # none drawn ahead sharded
    fixed = fixed_bytes(
        model,
        shape.optimizer_states,
        shape.strategy,
        noise_vectors=int(ahead) + shape.noise_buffers,
        shards=shards,
        low_precision=shape.low_precision,
    )
    info = {
        "memory_cap_bytes": cap,
        "cap_source": "training.memory_gb"
        if memory_cap_bytes is not None
        else f"{int(HEADROOM * 100)}% of free {device.type} memory",
        "fixed_bytes": fixed,
        "unit_bytes": per,
        "shards": shards,
    }
    if per is None:
        info["rule"] = "no transformer config to estimate from: the default chunk of 8"
        return 8, info
    room = int(MODEL_MARGIN * cap) - fixed
    if room < per:
        raise UserError(
            f"training.chunk_size: auto — one unit ({group_size} records x {seq_len} tokens) needs about "
            f"{(fixed + per) / 2**30:.2f} GiB with the model's fixed {fixed / 2**30:.2f} GiB, more than the "
            f"{MODEL_MARGIN * cap / 2**30:.2f} GiB usable of the {cap / 2**30:.2f} GiB cap "
            f"({info['cap_source']}; {int(MODEL_MARGIN * 100)}% for the estimate's error); lower "
            "group_size or seq_len, use LoRA, or "
            "raise training.memory_gb"
        )
    chunk = 1
    while chunk * 2 <= MAX_AUTO_CHUNK and chunk * 2 * per <= room:
        chunk *= 2
    info["rule"] = f"largest power of two with fixed + chunk x unit <= {MODEL_MARGIN:g} x cap"
    return chunk, info

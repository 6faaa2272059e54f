"""The ghost per-unit strategy: per-unit norms and the clipped sum without per-unit gradient copies.

For a layer ``y = W a`` applied to every token t of a unit, the unit's weight gradient is
``Σ_t g_t a_tᵀ`` (``g_t`` the gradient of the loss at the layer's output). Its squared norm is
``Σ_{t,s} (g_t·g_s)(a_t·a_s)`` — two T×T Gram matrices, never the d_out×d_in gradient
("ghost norm", Goodfellow 2015; Li et al. 2022). For ULS a unit is a user, so T = G·L: the user's
G records × L tokens are treated as one sequence. Per layer and per chunk the strategy picks the
cheaper of the ghost norm (memory ∝ T²) and materializing the unit's layer gradient
(∝ d_out·d_in), as mixed ghost clipping does (Bu et al. 2023).

The clipped sum comes from the same factors (book-keeping, Bu et al. 2023): with each unit's
clip factor ``c_u``, ``Σ_u c_u Σ_t g_t a_tᵀ`` is one matrix product of the scaled output
gradients with the activations. So one forward and one backward (to the layers' outputs, not to
the weights) give norms and the clipped sum; the weights' batch gradient is never formed. And
the clipped sum is built from exactly the quantities whose norms were measured, so the
sensitivity bound holds for what is summed, whatever the rounding.

Launches: on a GPU every op is a kernel launch, and a step of small kernels is launch-bound
whatever its FLOPs. So parameters of one shape are stacked and handled as one (GROUP_ELEMENTS
caps what a group's temporaries hold; a chunk big enough to fill the device keeps one layer at a
time): the single-use dense ghosts of one factor shape (GPT-2's twelve ``c_fc``, ...) get one
batched Gram product per factor, one batched dot for their norms and one batched product for their
clipped sums; the small materialized-only parameters of one size (biases, LayerNorms, LoRA factors
whose gradients are cheaper than their Grams) one stacked norm and one stacked sum. A ghost chunk
of GPT-2 small dispatches 1.24x a non-private forward and backward's kernels (2.20x one parameter
at a time; ``benchmarks/bench_ops.py``), with the same norms and sums (tests compare both). The
factor stacks follow the device (:data:`STACK_FACTORS`): the CPU, with no launches to save, keeps
one layer at a time.

What is captured and how (the registry :data:`GHOST_LAYERS`, keyed by layer type, like Opacus's
grad samplers): ``nn.Linear`` (and so peft's LoRA A/B, which are Linears), GPT-2's ``Conv1D``,
``nn.Embedding`` (a one-hot factor: Gram entries are token-id equalities), ``nn.LayerNorm``
(materialized: its gradients are d-vectors). A layer of any other type that owns trainable
parameters falls back to per-unit gradients **for that layer only**, computed by ``torch.func``
(vmap over units of the layer's vector-Jacobian product at its captured inputs). A parameter used
by several layers (GPT-2's tied ``wte``/``lm_head``) gets the cross terms of its contributions.

Precision: Gram matrices, norms, factors and sums are computed in float32 (float64 for a float64
model) from the captured tensors, whatever the autocast dtype of the forward. Under bf16/fp16
autocast the captured activations and output gradients are *kept* in that dtype and upcast at
each use (one layer at a time): the values are the same as upcasting them once at capture, so the
norms and the sums are bit-identical to that, while the chunk holds half the bytes (no float32
copy of every captured layer's input and output gradient until the clipped sum is formed).

Memory: a capture holds its layer's inputs and its output's gradient edge, never the output (so
what a non-private forward frees is freed here too), and an autocast GEMM layer's float32 input is
cast before the layer (one bf16 tensor for the GEMM, autograd and the capture): a chunk's peak is
the non-private forward and backward's, counted op by op (``benchmarks/bench_memory.py``).

Assumptions, checked: every layer sees a batch-first input whose leading dimension is the chunk's
record count (the engine's ``loss_fn`` contract); on its first chunk the strategy compares the
sum of its per-unit gradients with autograd's batch gradient and refuses (naming the parameter)
a model that uses a parameter outside the forward of the layers that own it, where no hook can
see it. FedAvg's unit update is a local-SGD delta, not a gradient: it keeps the vmap strategy.

The package, one part a concern (each module's docstring says what it holds):

- :mod:`~.capture`: what the forward's hooks keep of a layer call;
- :mod:`~.layers`: one file a layer type, registered by decorator (``GHOST_LAYERS``), and the
  ``torch.func`` fallback;
- :mod:`~.factors`: a parameter's use kept as its two factors, laid out by unit, with its rounding
  constants;
- :mod:`~.grams`: the Gram stage: a parameter's squared per-unit norms from the Gram matrices, the
  rows' norms, magnitudes and spreads their rounding bound reads, the Gram pairs' row sums (and
  their Triton kernel's gate), and the parameter's :class:`~.bound.Bound`;
- :mod:`~.stacks`: parameters of one shape stacked, so a group takes a few kernels (its members'
  bounds at once);
- :mod:`~.bound`: the proven upper bound on what a unit adds, from which its clip factor comes;
- :mod:`~.sums`: one parameter's clipped, weighted sum;
- :mod:`~.coverage`: which parameters a first chunk compares with autograd's batch gradient, and
  with respect to which tensors (the distribution hands the strategy its own: where the model is
  split over ranks, the forward uses gathered tensors, not its parameters);
- :mod:`~.strategy`: :class:`GhostPerUnit`, the composition of the above for one chunk.
"""

from userdp.engine.ghost.factors import Factored, GhostUnsupported
from userdp.engine.ghost.layers import GHOST_LAYERS, register_ghost_layer
from userdp.engine.ghost.stacks import GROUP_ELEMENTS
from userdp.engine.ghost.strategy import GhostPerUnit

__all__ = ["GHOST_LAYERS", "GROUP_ELEMENTS", "Factored", "GhostPerUnit", "GhostUnsupported", "register_ghost_layer"]

"""The model linter (Ponomareva et al. 2023, §5.5.1): modules that mix the records of a batch
break per-unit clipping. Both per-unit strategies (vmap and ghost) run it before training; the LM
jobs run it up front, before any pretraining or data preparation. Also what every per-unit strategy
reads from a model first: its trainable tensors (:func:`trainable_parameters`)."""

from __future__ import annotations

from torch import nn

from userdp.errors import UserError


def lint_model(model: nn.Module) -> None:
    """Refuse components that mix records within a batch: BatchNorm in training mode (a unit's
    update would then depend on the other units of the batch, so clipping no longer bounds it).

    Raises:
        UserError: naming the module at fault and the fix.
    """
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise UserError(
                f"module {name or type(model).__name__!r} is {type(mod).__name__} in training mode: "
                "it mixes records of a batch, so per-unit clipping no longer bounds a user's "
                "influence. Use LayerNorm/GroupNorm, or freeze it (module.eval()) with statistics "
                "from public data"
            )
        if isinstance(mod, nn.modules.instancenorm._InstanceNorm) and mod.track_running_stats and mod.training:
            raise UserError(
                f"module {name!r} ({type(mod).__name__}) tracks running statistics in training mode; "
                "set track_running_stats=False or call .eval() on it"
            )


def trainable_parameters(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    """The model's trainable tensors and their names, in ``named_parameters`` order: what every
    per-unit strategy clips and sums.

    Raises:
        UserError: the model has none."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise UserError("the model has no trainable parameters (requires_grad=True)")
    return [n for n, _ in named], [p for _, p in named]


def mixing_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules :func:`lint_model` would refuse in training mode (BatchNorm, InstanceNorm with
    running statistics): kept by a run so every release checks them again (a caller's loop may call
    ``model.train()`` after the run was built)."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.modules.batchnorm._BatchNorm)
        or (isinstance(mod, nn.modules.instancenorm._InstanceNorm) and mod.track_running_stats)
    ]


def buffer_versions(model: nn.Module) -> list[int]:
    """Each buffer's in-place version counter: a release must leave them all unchanged (a forward
    that updates running statistics from the un-noised cohort writes private data into every
    checkpoint's buffers)."""
    return [b._version for b in model.buffers()]


def check_release(model: nn.Module, mixing: list, versions_before: list[int] | None) -> None:
    """At every release: no record-mixing module in training mode, and (after the release) no
    buffer changed by it.

    Raises:
        UserError: naming the module or saying that a buffer changed."""
    for name, mod in mixing:
        if mod.training:
            raise UserError(
                f"module {name!r} ({type(mod).__name__}) is in training mode at a private step (the loop "
                "called model.train()?): it mixes the units of a batch and updates its statistics from "
                "the un-noised cohort; keep it in eval mode (module.eval()) for the whole run"
            )
    if versions_before is not None and buffer_versions(model) != versions_before:
        raise UserError(BUFFER_CHANGED)


#: the one line for a forward that writes into the model's buffers (any per-unit strategy)
BUFFER_CHANGED = (
    "a private step changed the model's buffers (running statistics computed from the "
    "un-noised cohort would be released with every checkpoint): freeze every module that "
    "updates buffers in its forward"
)


def mutates_captured(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.func refusing a forward that writes into a tensor it captured (a
    buffer updated in forward): the per-unit strategies say :data:`BUFFER_CHANGED` instead."""
    return isinstance(exc, RuntimeError) and "mutate a captured Tensor" in str(exc)

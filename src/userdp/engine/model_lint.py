"""The model linter (Ponomareva et al. 2023, §5.5.1): modules that mix the records of a batch
break per-unit clipping. Both per-unit strategies (vmap and ghost) run it before training; the LM
jobs run it up front, before any pretraining or data preparation."""

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

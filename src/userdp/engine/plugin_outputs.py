"""The guarantee's boundary for plugin parts: what a sampler or a noise mechanism returns is checked
where it enters the engine, once per step.

Plugins are trusted code (their statement says the accounting rests on their declaration), but
what they *return* is data the proof depends on: a cohort that names a user twice gives that user a
share of 2C in the step's sum while the run certifies the one-user epsilon; an id past the last
unit, or a float, picks another user's records; a mechanism that writes NaN into the sums releases
a NaN model with exit 0. Each is refused in one line naming the plugin, and a plugin that raises is
reported the same way (its module and the exception), never as a traceback from the plugin's file.

userdp's own parts are checked the same way where the check is cheap (a cohort's ids), and trusted
where it is not (a finite release from the built-in Gaussian needs no pass over the sums).

The caller's ``loss_fn`` is user code too: :func:`checked_loss_fn` checks what it returns (a
floating-point tensor, computed from the model's parameters) where the engine first uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from userdp.errors import UserError


def origin(part: Any) -> str:
    """The module whose code ``part`` (an object or a class) is."""
    return getattr(part, "__module__", None) or type(part).__module__


def built_in(part: Any) -> bool:
    """Whether ``part`` (an object or a class) is userdp's own code, not a plugin's."""
    mod = origin(part)
    return isinstance(mod, str) and mod.startswith("userdp.")


def describe(kind: str, part: Any, name: str | None = None) -> str:
    """``the sampler 'name' (module m)``: how a refusal or a statement names a part (``name``: the
    name it was registered and chosen by; default its own ``name``)."""
    name = name or getattr(part, "name", None) or type(part).__name__
    return f"the {kind} {name!r} (module {origin(part)})"


def call(kind: str, part: Any, fn: Callable, *args) -> Any:
    """``fn(*args)``; a plugin part's exception becomes one line naming the part.

    Raises:
        UserError: the plugin raised (built-in parts' exceptions pass through: a bug of userdp's
            own is a traceback to report)."""
    if built_in(part):
        return fn(*args)
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a plugin is one line naming it
        raise UserError(f"{describe(kind, part)} raised {type(exc).__name__}: {str(exc)[:200]}") from None


def checked_cohort(ids: Any, num_units: int, sampler: Any) -> np.ndarray:
    """The sampler's cohort as int64 unit ids, after checking that it is a 1-D array of distinct
    integers in ``[0, num_units)``: a unit named twice would count twice in the step's sum.

    Raises:
        UserError: naming the sampler and what is wrong."""
    who = describe("sampler", sampler)
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise UserError(f"{who} returned a cohort of shape {arr.shape}: it must be a 1-D array of unit ids")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise UserError(
            f"{who} returned unit ids of type {arr.dtype}: they must be integers (a float id "
            "would be rounded to another unit)"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_units:
        raise UserError(f"{who} returned unit id {lo if lo < 0 else hi}, outside [0, {num_units})")
    if np.unique(arr).size != arr.size:
        raise UserError(
            f"{who} returned a cohort that names a unit more than once: that unit's share of the "
            "step's sum would exceed the clip norm the run is accounted for"
        )
    return arr.astype(np.int64, copy=False)


def check_finite_release(sums: Sequence[torch.Tensor], noise: Any) -> None:
    """A plugin noise mechanism's output must be finite (one reduction and one host sync a step,
    only for plugins: the built-in Gaussian adds finite noise to finite sums).

    Raises:
        UserError: naming the mechanism."""
    if built_in(noise) or not sums:
        return
    ok = torch.stack([torch.isfinite(s).all() for s in sums]).all()
    if not bool(ok):
        raise UserError(
            f"{describe('noise mechanism', noise)} wrote a non-finite value into the step's noisy sum: "
            "nothing of this step was applied (the step is counted as spent)"
        )


def check_finite_scalar(value: Any, noise: Any) -> float:
    """A plugin mechanism's noise on the count query: a finite float.

    Raises:
        UserError: naming the mechanism."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"{describe('noise mechanism', noise)} returned {type(value).__name__} as the count "
            "query's noise: it must be a number"
        ) from None
    if not np.isfinite(x):
        raise UserError(f"{describe('noise mechanism', noise)} returned {x} as the count query's noise")
    return x


def _untracked(t: torch.Tensor) -> bool:
    """Whether ``t`` is a loss that autograd does not track where it should: eagerly, one that does
    not require grad; under torch.func's transforms (the vmap strategy's ``grad``), one that does not
    require grad at the ``grad`` transform's level (under ``vmap`` alone nothing is differentiated,
    and nothing is checked)."""
    try:
        wrapped = bool(torch._C._functorch.is_functorch_wrapped_tensor(t))
        stack = torch._C._functorch.get_interpreter_stack() or ()
        under_grad = any(i.key() == torch._C._functorch.TransformType.Grad for i in stack)
    except AttributeError:  # a torch without the queries: only eager losses are checked
        wrapped, under_grad = False, False
    if wrapped and not under_grad:
        return False
    return not t.requires_grad


def checked_loss_fn(loss_fn: Callable) -> Callable:
    """``loss_fn`` with its output checked at every call: a ``torch.Tensor`` of floating point, and —
    under autograd — one that depends on the model's parameters (a float, an integer tensor, or a
    detached loss otherwise failed deep inside the per-unit strategy, or trained on nothing).

    Raises (from the returned function):
        UserError: naming ``loss_fn`` and what it returned."""
    if getattr(loss_fn, "_userdp_checked", False):
        return loss_fn

    @functools.wraps(loss_fn)
    def checked(model, batch):
        out = loss_fn(model, batch)
        if not isinstance(out, torch.Tensor):
            raise UserError(
                f"loss_fn returned {type(out).__name__}: it must return a torch.Tensor holding one loss "
                "per record (shape [n])"
            )
        if not out.is_floating_point():
            raise UserError(f"loss_fn returned a {out.dtype} tensor: the losses must be floating point")
        if torch.is_grad_enabled() and _untracked(out) and any(p.requires_grad for p in model.parameters()):
            raise UserError(
                "loss_fn returned a tensor that does not depend on the model's parameters (detached, or "
                "computed under torch.no_grad()): compute the loss from model(batch)"
            )
        return out

    checked._userdp_checked = True  # type: ignore[attr-defined]
    return checked

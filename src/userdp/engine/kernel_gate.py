"""Whether a hand-written Triton kernel may serve a device: the one rule the engine's kernels share.

Each kernel (the clipped sum's operand, the Gram-pair reductions, a LayerNorm's per-unit
gradients) has a switch — "auto": CUDA only; "on": any device (tests, under Triton's
interpreter); "off": never — and a check against the torch passes it replaces. The check runs once
per process and device type; its answer is kept, and a kernel that fails it, raises in it or
cannot be imported is warned about once, naming why, and the torch passes serve instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def allowed(
    switch: str, checked: dict, device: torch.device, check: Callable[[torch.device], bool | str], what: str
) -> bool:
    """Whether the kernel ``what`` may run on ``device`` under ``switch``; ``checked`` keeps each device
    type's answer (True, or why not) from ``check``, asked at most once per type."""
    kind = device.type
    if switch == "off" or (switch == "auto" and kind != "cuda"):
        return False
    state = checked.get(kind)
    if state is None:
        try:
            state = check(device)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run is reported, never silent
            state = f"{type(exc).__name__}: {str(exc)[:160]}"
        checked[kind] = state
        if state is not True:
            warnings.warn(
                f"userdp: {what} is not used on {kind} ({state}); torch's passes serve instead (the "
                "same results, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return state is True

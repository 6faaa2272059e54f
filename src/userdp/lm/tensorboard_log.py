"""``output.tensorboard: true``: the run's metrics also as TensorBoard scalars, in ``<run>/tensorboard``.

TensorBoard is the ecosystem's usual viewer (``tensorboard --logdir runs/``). The scalars are the
rows of ``metrics.jsonl`` and the held-out evaluation: ``privacy/epsilon_spent`` (an upper bound
after each step), and — computed on private data and NOT privatized, as in metrics.jsonl —
``train/loss``, ``train/fraction_clipped`` and ``train/nonfinite_units``; ``perf/*`` and
``eval/*`` (held-out users). The folder is disclosed as such in the report. A resumed run writes
with ``purge_step`` at the checkpoint's step, so TensorBoard drops the steps of the interrupted
run past it (the engine replays or re-runs them), as metrics.jsonl is cut back.

Writing uses ``torch.utils.tensorboard`` (it needs the ``tensorboard`` package: the
``userdp[tensorboard]`` extra); only rank 0 writes.
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
from pathlib import Path

from userdp.errors import UserError

FOLDER = "tensorboard"

#: metrics.jsonl field -> TensorBoard tag
#: (no per-step cohort size, token count, throughput or step time: each is an exact count of the
#: step's private cohort, released every step without noise)
TAGS = {
    "epsilon": "privacy/epsilon_spent",
    "loss": "train/loss",
    "fraction_clipped": "train/fraction_clipped",
    "nonfinite_units": "train/nonfinite_units",
    "clip_norm": "train/clip_norm",
}


def check_available(enabled: bool) -> None:
    """Refuse ``output.tensorboard: true`` up front when the package is missing (before any data
    is read or any step is taken).

    Raises:
        UserError: naming the key and the extra to install."""
    if not enabled:
        return
    _require_package()
    # found is not working: import and exercise the writer once (a broken install fails here, in
    # one line, not mid-run after steps were spent)
    try:
        with tempfile.TemporaryDirectory(prefix="userdp-tb-") as probe:
            from torch.utils.tensorboard import SummaryWriter  # the optional dependency, loaded only when asked

            w = SummaryWriter(probe)
            w.add_scalar("probe", 1.0, 1)
            w.add_text("probe", "probe", 1)
            w.close()
    except Exception as exc:  # noqa: BLE001 - any failure of the optional package is one line
        raise UserError(
            f"output.tensorboard: true, but the tensorboard package does not work here "
            f"({type(exc).__name__}: {str(exc)[:160]}); reinstall it (pip install 'userdp[tensorboard]') "
            "or set output.tensorboard: false"
        ) from None


def _require_package() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "output.tensorboard: true needs the tensorboard package: pip install 'userdp[tensorboard]' "
            "(or set output.tensorboard: false; metrics.jsonl holds the same rows)"
        )


def _finite(v) -> bool:
    """A number TensorBoard can plot (a non-private run's epsilon "inf", a NaN loss: skipped)."""
    return isinstance(v, (int, float)) and math.isfinite(v)


class Scalars:
    """The run's TensorBoard writer (a no-op when disabled or on a rank other than 0)."""

    def __init__(self, root: Path, enabled: bool, start_step: int = 0):
        self._w = None
        if enabled:
            _require_package()  # the writer itself was exercised by check_available before the run began
            from torch.utils.tensorboard import SummaryWriter  # the optional dependency, loaded only when asked

            self._w = SummaryWriter(str(Path(root) / FOLDER), purge_step=start_step + 1 if start_step else None)

    def step(self, row: dict) -> None:
        """One metrics.jsonl row (its finite numbers; a non-private run's epsilon "inf" is skipped)."""
        if self._w is None:
            return
        for key, tag in TAGS.items():
            v = row.get(key)
            if _finite(v):
                self._w.add_scalar(tag, v, row["step"])

    def evaluation(self, eval_json: dict, step: int) -> None:
        """The held-out evaluation (before, at step 0, and after, at the last step)."""
        if self._w is None:
            return
        for when, at in (("before", 0), ("after", step)):
            part: dict | None = eval_json.get(when)
            for k in ("perplexity", "loss"):
                v = part.get(k) if isinstance(part, dict) else None
                if _finite(v):
                    self._w.add_scalar(f"eval/heldout_{k}", v, at)

    def text(self, tag: str, body: str, step: int) -> None:
        if self._w is not None:
            self._w.add_text(tag, body, step)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None

"""Search spaces for `userdp tune`: which config keys vary, and how a trial draws them.

A space is a YAML mapping of dotted config keys to

* a list — a uniform choice among its values (a grid, searched at random);
* ``{log_uniform: [low, high]}`` or ``{uniform: [low, high]}`` — a continuous draw.

Private selection (Papernot & Steinke 2022) needs each trial's hyperparameters drawn independently
of the data, from a distribution fixed in advance: random search, never a grid walked in order.
Keys that change the privacy mechanism (:data:`MECHANISM_KEYS`) must be lists, so the mechanisms
are finitely many and each is calibrated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import yaml

from userdp.errors import UserError
from userdp.fileio import read_input
from userdp.lm.config import StrictLoader

MECHANISM_KEYS = (
    "training.algorithm",
    "training.group_size",
    "training.cohort_size",
    "training.steps",
    "privacy.sampler",
    "training.clipping",
    "privacy.accountant",
    "privacy.delta",
)
MAX_CHOICES = 1000
REFUSED_KEYS = (
    "privacy.epsilon",
    "privacy.noise_multiplier",
    "training.seed",
    "data.",
    "audit.",
    "output.",
    "plan",
    "planning.",
)


@dataclass(frozen=True)
class Dim:
    key: str
    kind: str  # choice | log_uniform | uniform
    values: tuple

    def draw(self, rng: np.random.Generator):
        if self.kind == "choice":
            return self.values[int(rng.integers(len(self.values)))]
        lo, hi = self.values
        if self.kind == "log_uniform":
            return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        return float(rng.uniform(lo, hi))


@dataclass(frozen=True)
class Space:
    dims: tuple

    def draw(self, rng: np.random.Generator) -> dict:
        """One trial's hyperparameters."""
        return {d.key: d.draw(rng) for d in self.dims}

    def mechanisms(self) -> list[dict]:
        """Every combination of the mechanism keys' values (the mechanisms a trial may run)."""
        combos = [{}]
        for d in self.dims:
            if d.key in MECHANISM_KEYS:
                combos = [{**c, d.key: v} for c in combos for v in d.values]
        return combos


def mechanism_key(params: dict) -> str:
    """A stable name for the mechanism a trial's hyperparameters select."""
    parts = [f"{k}={params[k]}" for k in MECHANISM_KEYS if k in params]
    return ",".join(parts) or "default"


class _SpaceLoader(StrictLoader):
    """The config's loader (a key given twice is refused) without aliases: ``*name`` is refused (an
    alias bomb would expand into a space of billions of values)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "YAML aliases (*name) are not allowed in a search space", mark
            )
        return super().compose_node(parent, index)


def load_space(path: str) -> Space:
    """Read and check a search space file.

    Raises:
        UserError: an unreadable file, a key that must not be tuned, a malformed range.
    """
    text = read_input(path, f"--search {path}")
    try:
        raw = yaml.load(text, Loader=_SpaceLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise UserError(f"--search {path}: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"--search {path}{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    return parse_space(raw, str(path))


def parse_space(raw, where: str = "search space") -> Space:
    if not isinstance(raw, dict) or not raw:
        raise UserError(
            f"{where}: expected a mapping of config keys to values (a list, or "
            "{log_uniform: [low, high]} / {uniform: [low, high]})"
        )
    dims = []
    for key, spec in raw.items():
        key = str(key)
        if any(key == r or (r.endswith(".") and key.startswith(r)) for r in REFUSED_KEYS):
            raise UserError(
                f"{where}: {key} cannot be tuned (the budget, the data and the seeds are fixed by the tuning run)"
            )
        if isinstance(spec, list):
            if not spec:
                raise UserError(f"{where}: {key}: an empty list")
            if len(spec) > MAX_CHOICES:
                raise UserError(f"{where}: {key}: {len(spec)} values (at most {MAX_CHOICES})")
            bad = [v for v in spec if isinstance(v, (list, dict)) or (isinstance(v, float) and not math.isfinite(v))]
            if bad:
                raise UserError(f"{where}: {key}: {bad[0]!r} is not a single finite value")
            if key == "training.algorithm" and "nonprivate" in spec:
                raise UserError(
                    f"{where}: training.algorithm: nonprivate cannot be a trial (it has no guarantee "
                    "to account tuning against)"
                )
            dims.append(Dim(key, "choice", tuple(spec)))
        elif isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in ("log_uniform", "uniform"):
            kind, rng = next(iter(spec.items()))
            ok = (
                isinstance(rng, list)
                and len(rng) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in rng)
                and rng[0] < rng[1]
                and (kind == "uniform" or rng[0] > 0)
            )
            if not ok:
                raise UserError(
                    f"{where}: {key}: {kind} needs finite numbers [low, high] with low < high"
                    + (" and low > 0" if kind == "log_uniform" else "")
                )
            if key in MECHANISM_KEYS:
                raise UserError(
                    f"{where}: {key} changes the privacy mechanism: give a list of values "
                    "(each is calibrated), not a range"
                )
            dims.append(Dim(key, kind, (float(rng[0]), float(rng[1]))))
        else:
            raise UserError(f"{where}: {key}: expected a list of values or {{log_uniform|uniform: [low, high]}}")
    return Space(tuple(dims))


def validate_space(space: Space, check_point, where: str = "search space") -> None:
    """Every point the space can draw must be a valid config, checked before anything is spent:
    every value of every list, both ends of every range (one key at a time, the others at their
    first value), and every combination of the mechanism keys.

    Args:
        check_point: params dict -> None, raising UserError for an invalid config.

    Raises:
        UserError: naming the key and the value whose config is invalid."""
    first = {d.key: d.values[0] for d in space.dims}
    for d in space.dims:
        for v in d.values:
            try:
                check_point({**first, d.key: v})
            except UserError as exc:
                raise UserError(f"{where}: {d.key} = {v!r} gives an invalid config: {exc}") from None
    for m in space.mechanisms():
        try:
            check_point({**first, **m})
        except UserError as exc:
            raise UserError(f"{where}: the mechanism {mechanism_key(m)} gives an invalid config: {exc}") from None

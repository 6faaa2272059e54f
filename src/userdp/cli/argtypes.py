"""argparse value types shared by every sub-command: a bad number or path is refused by argparse
in one line naming the option (exit status 2), before any work starts.

Each type takes the option's text and returns the value or raises ``argparse.ArgumentTypeError``.
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable
from pathlib import Path

from userdp.validation import DEVICE_SPEC


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _checked(parse: Callable[[str], float | int], ok: Callable, what: str, name: str, doc: str):
    """A type that parses the text and refuses a value outside ``what`` ("must be <what>, got <text>")."""

    def convert(text: str):
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    convert.__name__, convert.__doc__ = name, doc
    return convert


positive_float = _checked(_number, lambda v: v > 0, "> 0", "positive_float", "A finite number > 0.")
nonneg_float = _checked(_number, lambda v: v >= 0, ">= 0", "nonneg_float", "A finite number >= 0.")
rate = _checked(_number, lambda v: 0 < v <= 1, "in (0, 1]", "rate", "A number in (0, 1].")
open_unit = _checked(_number, lambda v: 0 < v < 1, "in (0, 1)", "open_unit", "A number in (0, 1) (a delta).")
positive_int = _checked(_integer, lambda v: v >= 1, "an integer >= 1", "positive_int", "An integer >= 1.")
nonneg_int = _checked(_integer, lambda v: 0 <= v < 2**63, "an integer >= 0", "nonneg_int", "An integer >= 0 (a seed).")


def sample_rate(text: str) -> float:
    """A rate in (0, 1) for ``--sample`` (each training user kept with that probability). A count is
    refused with the reason: a rate K/N would make one user's membership depend on the others'."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a rate in (0, 1), got {text}: each training user is kept with that probability, whatever "
            "the number of users (a count K would be a rate K/N, so one user could change whether others are "
            "sampled); for about K of N users give K/N"
        )
    return value


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""
    return _checked(
        _integer,
        lambda v: lo <= v <= hi,
        f"an integer in [{lo}, {hi}]",
        f"integer in [{lo}, {hi}]",
        f"An integer in [{lo}, {hi}].",
    )


def list_of(item: Callable[[str], float | int]) -> Callable[[str], tuple]:
    """A comma-separated, non-empty list whose items each pass ``item``."""

    def parse(text: str) -> tuple:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(item(p) for p in parts)

    parse.__name__ = "list"
    return parse


def device(text: str) -> str:
    """A device spec: auto, cpu, cuda or cuda:<index> (lower-cased). Whether the machine has it is
    checked when the job starts (``userdp.devices.resolve_device``), not here."""

    spec = text.strip().lower()
    if not DEVICE_SPEC.match(spec):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:<index>, got {text!r}")
    return spec


def add_device_option(parser: argparse.ArgumentParser, what: str, default: str | None = None) -> None:
    """``--device D`` on ``parser``: where ``what`` runs (None: the config's ``model.device``)."""
    tail = f"default: {default}" if default else "default: the config's model.device"
    parser.add_argument(
        "--device",
        type=device,
        default=default,
        metavar="D",
        help=f"where {what}: auto (a GPU when there is one), cpu, cuda or cuda:<index> ({tail})",
    )


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def plot_file(text: str) -> str:
    """A plot path: .png/.pdf/.svg, in an existing folder, not a folder itself."""
    p = Path(text)
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"must end in {', '.join(PLOT_SUFFIXES)}, got {text!r}")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(p.parent)!r} does not exist")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder")
    return text


def output_dir(text: str) -> str:
    """A folder to create or fill: not empty text, not an existing file."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a folder (or leave the option out for the default)")
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    return text


class registered:
    """argparse ``choices`` read from a registry (:mod:`userdp.registry`) when first used, so that
    a plugin's names are accepted and ``userdp --help`` does not import the registry's module."""

    def __init__(self, module: str, attr: str, *extra: str):
        self.module, self.attr, self.extra = module, attr, extra

    def _names(self) -> tuple[str, ...]:
        return (*self.extra, *getattr(importlib.import_module(self.module), self.attr).names())

    def __contains__(self, value) -> bool:
        return value in self._names()

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


#: the registered accountants' names (a plugin's included); give the option a ``metavar``, since
#: argparse lists plain choices while it builds the parser, which would import the accountants
ACCOUNTANT_NAMES = registered("userdp.accounting.accountants", "ACCOUNTANTS")

"""argparse value types shared by every sub-command: a bad number or path is refused by argparse
in one line naming the option (exit status 2), before any work starts.

Each type takes the option's text and returns the value or raises ``argparse.ArgumentTypeError``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable


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


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def rate(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text)
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def open_unit(text: str) -> float:
    """A number in (0, 1) (a delta)."""
    value = _number(text)
    if not (0 < value < 1):
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not (lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {text}")
        return value

    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def list_of(item: Callable[[str], float | int]) -> Callable[[str], tuple]:
    """A comma-separated, non-empty list whose items each pass ``item``."""

    def parse(text: str) -> tuple:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(item(p) for p in parts)

    parse.__name__ = "list"
    return parse


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
    """A folder to create or fill: not an existing file, and its parent must be creatable."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    return text

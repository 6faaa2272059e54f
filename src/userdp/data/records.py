"""What a source yields (``RecordBatch``) and the count of everything it did not yield (``DropReport``).

Nothing is dropped silently: every reader and the store builder add each dropped row (or user)
to a :class:`DropReport` under a named reason, with a few examples naming file and line/row.
"""

from __future__ import annotations

import dataclasses

# Reasons used across the package (a reader may add others; they all surface in the output).
EMPTY_TEXT = "empty_or_whitespace_text"
USERS_WITHOUT_RECORDS = "users_left_with_no_records"
TAG_WIKI = "stackexchange_tag_wiki_rows"
COMMUNITY_USER = "stackexchange_community_user_rows"
NO_OWNER = "stackexchange_rows_without_owner"
MALFORMED_ROW = "stackexchange_malformed_rows"
OTHER_POST_TYPE = "stackexchange_other_post_types"
PUBLIC_PLAYS = "shakespeare_speeches_in_public_plays"

# Which reasons count users (the rest count records/rows).
ONE_RECORD_USERS = "cc_news_users_with_one_record"
USER_REASONS = {USERS_WITHOUT_RECORDS, ONE_RECORD_USERS}

MAX_EXAMPLES = 3


@dataclasses.dataclass
class DropReport:
    """Counts of dropped rows per reason, with up to three examples each ("file:line ...")."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def add(self, reason: str, n: int = 1, example: str | None = None) -> None:
        if n <= 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + int(n)
        if example is not None:
            ex = self.examples.setdefault(reason, [])
            if len(ex) < MAX_EXAMPLES:
                ex.append(example)

    def merge(self, other: DropReport) -> None:
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        for k, ex in other.examples.items():
            mine = self.examples.setdefault(k, [])
            mine.extend(ex[: max(0, MAX_EXAMPLES - len(mine))])

    def get(self, reason: str) -> int:
        return self.counts.get(reason, 0)

    @property
    def total_records(self) -> int:
        return sum(v for k, v in self.counts.items() if k not in USER_REASONS)

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": dict(sorted(self.examples.items()))}

    @classmethod
    def from_dict(cls, d: dict) -> DropReport:
        return cls(dict(d.get("counts", {})), {k: list(v) for k, v in d.get("examples", {}).items()})

    def lines(self) -> list[str]:
        if not self.counts:
            return ["dropped: nothing"]
        out = []
        for k, v in sorted(self.counts.items()):
            unit = "users" if k in USER_REASONS else "records"
            ex = self.examples.get(k)
            out.append(f"dropped {v:,} {unit}: {k}" + (f" (e.g. {ex[0]})" if ex else ""))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclasses.dataclass
class RecordBatch:
    """Records in source order: parallel lists; ``dates`` is None when the source has no dates.

    ``lines`` holds, for each record, its line (JSONL), row (CSV/Parquet/HF) or row id (XML) in
    ``file``, used to name records the store builder drops (e.g. empty text).
    """

    users: list[str]
    texts: list[str | None]
    dates: list[str | None] | None = None
    lines: list[int] | None = None
    file: str = ""
    line_kind: str = "line"

    def where(self, i: int) -> str:
        if self.lines is None:
            return self.file or "?"
        return f"{self.file}:{self.line_kind} {self.lines[i]}"

    def __len__(self) -> int:
        return len(self.users)

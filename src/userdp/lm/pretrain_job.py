"""The ``userdp pretrain`` job: public text -> BPE tokenizer + pretrained preset -> a model folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

from userdp.caches import fingerprint
from userdp.data.acquire import cached_store, file_signature, read_public_file, stackexchange_source
from userdp.data.shakespeare import public_text
from userdp.data.tokenize import PublicText, load_tokenizer, train_bpe
from userdp.devices import resolve_device
from userdp.errors import UserError
from userdp.fileio import atomic_dir
from userdp.lm.pretrain import PretrainSpec, pretrain_model, save_pretrained


def public_texts(args) -> tuple[list[str], str]:
    if args.public_text:
        if not args.declare_public:
            raise UserError(
                "--public-text: pass --declare-public to state that this text is public "
                "(pretraining is not private; it must not contain the users' records)"
            )
        return read_public_file(args.public_text, args.text_field), f"declared-public file {args.public_text}"
    if args.stackexchange:
        if not args.declare_public:
            raise UserError("--stackexchange: pass --declare-public to state that these sites are public")
        sites = tuple(s for s in (args.sites or "").split(",") if s) or None
        src = stackexchange_source(args.stackexchange, sites, public=True)
        key = "se-" + fingerprint(file_signature(Path(args.stackexchange)), [s.name for s in src.sites])
        store = cached_store(src, key, lambda m: None)
        texts = [t for _, b in store.iter_text_batches() for t in b if t]
        return texts, f"Stack Exchange sites {', '.join(s.name for s in src.sites)} declared public"

    plays = [p for p in (args.plays or "hamlet,macbeth,the-tempest,twelfth-night").split(",") if p]
    return public_text(plays), f"the whole plays {', '.join(plays)}"


def pretrain_job(args) -> dict:
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {out}: exists and is not an empty folder")
    try:  # refuse an unwritable output before any work, and write into a sibling then rename
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.probe{os.getpid()}")
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise UserError(f"--output {out}: cannot write there ({exc.strerror or exc})") from None

    device = resolve_device(getattr(args, "device", "auto"), name="--device")
    texts, desc = public_texts(args)
    if not texts:
        raise UserError(f"no public text found ({desc})")
    if args.base_model:
        tok = load_tokenizer(args.base_model)
    else:
        tok = train_bpe(PublicText(texts, description=desc), args.vocab_size)
    t0 = time.time()
    spec = PretrainSpec(
        preset=args.preset,
        seq_len=args.seq_len,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        base_model=args.base_model,
    )
    model, info = pretrain_model(texts, tok, spec, device=device)
    info.update(
        public_text=desc,
        seconds=round(time.time() - t0, 1),
        preset=args.preset,
        vocab_size=tok.get_vocab_size(),
        seq_len=args.seq_len,
        output=str(out),
    )
    with atomic_dir(out, keep_existing=False) as tmp:  # an empty folder there (checked above) is replaced
        save_pretrained(model, tok, tmp, info)
    return info

"""The ``userdp evaluate`` job: resolve the model and the held-out users, then evaluate."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from userdp.caches import cache_in, private_cache_for
from userdp.data.sources import detect_format
from userdp.data.tokenize import load_tokenizer
from userdp.devices import resolve_device
from userdp.engine.journal import JOURNAL, journal_header
from userdp.errors import UserError
from userdp.fileio import MANIFEST, is_owned, verify_manifest, write_json
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.evaluate import Personalization, evaluate_lm
from userdp.lm.evaluate import personalize as run_personalize
from userdp.lm.prepare import build_datasets, prepare_data
from userdp.lm.run_dir import RunDir, verify_files


def _trainer_output(t: Path) -> bool:
    """Whether ``t`` is a :class:`userdp.hf.PrivateTrainer`'s output_dir (its config.yaml states the
    Trainer's settings under ``hf_trainer:``, not a ``userdp train`` config)."""
    if not (t / "config.yaml").is_file():
        return False
    raw = C.load_yaml(t / "config.yaml")
    return isinstance(raw, dict) and "hf_trainer" in raw


def _run_context(run: Path) -> dict:
    """The config and data fingerprints the run's ledger journal was bound to; the run's
    config.yaml must still hash to what the run trained with.

    Raises:
        UserError: the journal is missing or unreadable, or config.yaml was edited."""
    journal = run / "checkpoints" / JOURNAL
    try:
        context = journal_header(journal)["context"]
    except UserError:
        raise UserError(f"{journal}: missing or unreadable, so the run's held-out users cannot be verified") from None
    if not RunDir(run).matches_journal(context):
        raise UserError(
            f"{run / 'config.yaml'}: edited since the run trained (its checksum differs from the one in {journal})"
        )
    return context


@dataclass(frozen=True)
class EvalSource:
    """Which users a model folder is evaluated on: those a config names (``config``), or a data
    source (``data``, in format ``fmt``; None: detected); ``overrides``: ``--set`` keys, applied to
    that config (or to a run directory's own)."""

    data: str | None = None
    fmt: str | None = None
    config: str | None = None
    overrides: tuple[str, ...] = ()


def _resolve_target(t: Path, target: str, source: EvalSource):
    """(the model folder, the config naming its evaluation users) of ``userdp evaluate TARGET``: a run
    directory's own, a PrivateTrainer output_dir's or a model folder's model, with --data/--config."""
    data, fmt, config, overrides = source.data, source.fmt, source.config, list(source.overrides)

    def holds_model(d: Path) -> bool:  # a saved model, or a LoRA adapter (a quantized base's is always one)
        return (d / "config.json").is_file() or (d / "adapter_config.json").is_file()

    trainer_output = _trainer_output(t)
    if (t / "config.yaml").is_file() and holds_model(t / "model") and not trainer_output:
        model_dir = t / "model"
        cfg = C.load_config(t / "config.yaml", overrides or [])
    elif holds_model(t) or (trainer_output and holds_model(t / "model")):
        # a model folder, or a PrivateTrainer's output_dir: its model, on the users --data or --config name
        model_dir = t / "model" if trainer_output else t
        if not (config or data) and trainer_output:
            raise UserError(
                f"{target}: a PrivateTrainer output_dir; the Trainer's eval_dataset was never saved, so "
                "userdp cannot tell its held-out users: give --data FILE (records of users the Trainer "
                "did not train on) or --config, or call trainer.evaluate() in your script"
            )
        if config:
            cfg = C.load_config(config, overrides or [])
        elif data:
            sets = list(overrides or [])
            if data == "shakespeare":
                sets.append("data.source=shakespeare")
            else:
                sets += [f"data.source={fmt or detect_format(data)}", f"data.path={data}"]
            cfg = C.load_config(None, sets)
        else:
            raise UserError(f"{target}: a model folder needs --data or --config to say which users to evaluate on")
    else:
        raise UserError(
            f"{target}: neither a finished userdp run directory (config.yaml + model/) nor a model folder (config.json)"
        )
    return model_dir, cfg


def evaluate_target(
    target: str,
    source: EvalSource | None = None,
    *,
    personalize: bool = False,
    max_users: int | None = None,
    device: str | None = None,
) -> dict:
    """Evaluate a run directory's released model, or a model folder, on held-out users (``userdp
    evaluate``); ``personalize``, ``max_users`` and ``device`` set ``eval.personalize``,
    ``data.max_eval_users`` and ``model.device``."""
    source = source or EvalSource()
    t = Path(target)
    model_dir, cfg = _resolve_target(t, target, source)
    extra = ["training.selection=random"]  # evaluation reads held-out users only
    extra.append(f"eval.personalize={'true' if personalize else 'false'}")  # the flag's, not the run's
    if max_users is not None:
        extra.append(f"data.max_eval_users={max_users}")
    if device is not None:
        extra.append(f"model.device={device}")
    cfg = C.from_dict(C.apply_overrides(C.to_dict(cfg), extra))
    run_context = _run_context(t) if model_dir == t / "model" else None
    if run_context is not None:  # a run's released model, checkpoint and adapter: verified before use
        verify_files(RunDir(t))
    elif (model_dir / MANIFEST).is_file():
        verify_manifest(model_dir)

    dev = resolve_device(cfg.model.device)  # before loading: a wrong --device costs nothing
    model = models.load_local(model_dir, device=dev)
    if not models.is_quantized(model):  # a quantized base is placed while loading
        model.to(dev)
    tok = load_tokenizer(model_dir)
    if cfg.output.cache == "run":  # the run keeps the private caches of its data in <run>/cache
        if run_context is not None or is_owned(t / "cache"):  # a later `userdp evaluate` reuses the run's
            with cache_in(t / "cache"):
                return _evaluate(t, cfg, model, tok, model_dir, run_context)
        with tempfile.TemporaryDirectory(prefix="userdp-eval-cache-") as tmp, cache_in(Path(tmp)):
            return _evaluate(t, cfg, model, tok, model_dir, run_context)
    where = private_cache_for(cfg.output.cache, t)  # a project's folder (shared: None)
    if where is not None:
        with cache_in(where):
            return _evaluate(t, cfg, model, tok, model_dir, run_context)
    return _evaluate(t, cfg, model, tok, model_dir, run_context)


def _evaluate(t: Path, cfg, model, tok, model_dir: Path, run_context) -> dict:
    prep = prepare_data(cfg.data, log=lambda m: None)
    if run_context is not None and run_context.get("data_fingerprint") != prep.data_fingerprint:
        raise UserError(
            f"{t / 'config.yaml'}: the data or the held-out split differs from the one the run "
            "trained with (a changed data file, data.split_seed or --set): users it trained on "
            "would be evaluated as held out"
        )
    _, eval_data = build_datasets(
        prep, tok, seq_len=cfg.tokenizer.seq_len, selection=cfg.training.selection, log=lambda m: None
    )
    res = {
        "model": str(model_dir),
        "split": prep.split_rule,
        "heldout": evaluate_lm(model, eval_data, batch_size=cfg.eval.batch_size),
    }
    if cfg.eval.personalize:
        res["personalization"] = run_personalize(
            model, eval_data, how=Personalization(cfg.eval.personalize_lr, cfg.eval.personalize_epochs)
        )
    if (t / "config.yaml").is_file():
        write_json(t / "evaluate.json", res)
    return res

"""The layout of a ``userdp train`` run directory (one place, so every job agrees on it).

```
<run>/
  config.yaml          the resolved configuration (defaults + file + --set)
  metrics.jsonl        one JSON object per step: step, epsilon, clip_norm, journal (public: nothing in it is
                       a function of the step's cohort)
  diagnostics.jsonl    PRIVATE, never released: per step the training loss, the fraction of units clipped
                       and the non-finite units, each computed on the cohort without noise
  tensorboard/         PRIVATE (output.tensorboard): the rows of both files as TensorBoard scalars
  eval.json            held-out-user loss and perplexity before and after
  checkpoints/         engine checkpoints (safetensors + the privacy ledger: ledger_journal.jsonl, a hash
                       chain, and ledger_head.json, its head, rewritten after every line)
  tokenizer/           the tokenizer used (trained on declared-public text)
  model/               the final model: AutoModelForCausalLM.from_pretrained(<run>/model); MANIFEST.json
                       (checksums, verified on every read) and README.md (a model card stating the guarantee)
  adapter/             the LoRA adapter (only with model.lora.save_adapter)
  privacy.json         the privacy statement's data (Ponomareva et al. 2023, §5.3.3)
  report.md, report.json   the privacy statement (written by `userdp train`, and again by `userdp report`)
  curves.png           PRIVATE: the training loss and epsilon against step
  state.json           job state: split, counts, status (running/interrupted/done)
```
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from userdp.engine.journal import JOURNAL, check_cited, read_chain
from userdp.errors import UserError
from userdp.fileio import MANIFEST, sha256_file, verify_manifest, write_json
from userdp.lm import config as C

#: where a release bundle (``userdp export``) keeps the evidence ``userdp report`` verifies; the
#: model's files sit at the bundle's root, as the Hugging Face Hub expects them
BUNDLE_EVIDENCE = "userdp"


@dataclass(frozen=True)
class RunDir:
    """A run directory at ``root``; ``model_root``: where the released model is when it is not
    ``root/model`` (a release bundle's root, :data:`BUNDLE_EVIDENCE`)."""

    root: Path
    model_root: Path | None = None

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def diagnostics(self) -> Path:
        """The un-noised per-step diagnostics (loss, fraction clipped, non-finite units): private."""
        return self.root / "diagnostics.jsonl"

    @property
    def eval(self) -> Path:
        return self.root / "eval.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def model(self) -> Path:
        return self.model_root if self.model_root is not None else self.root / "model"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def privacy(self) -> Path:
        return self.root / "privacy.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def curves(self) -> Path:
        return self.root / "curves.png"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    def config_sha256(self) -> str:
        """sha256 of config.yaml's bytes (what the journal of a run begun before userdp 0.3 is bound to)."""
        return sha256_file(self.config)

    def config_fingerprint(self) -> str:
        """The privacy fingerprint of config.yaml (:func:`userdp.lm.config.privacy_fingerprint`):
        what a run's ledger journal is bound to; its performance settings may change on resume.

        Raises:
            UserError: config.yaml is missing or not a valid YAML mapping."""
        return C.privacy_fingerprint(C.load_yaml(self.config))

    def matches_journal(self, context: dict) -> bool:
        """Whether config.yaml is the configuration a journal ``context`` was bound to: a
        ``userdp train`` config by its privacy fingerprint (by its bytes before 0.3); a Trainer
        run's (``hf_trainer:``, :mod:`userdp.hf`) by the engine config it states, which the engine
        bound the journal to (``engine_privacy_config_sha256``)."""
        if "config_privacy_sha256" in context:
            return context["config_privacy_sha256"] == self.config_fingerprint()
        if "config_sha256" in context:
            return context["config_sha256"] == self.config_sha256()  # a run begun before 0.3
        raw = C.load_yaml(self.config)
        hf = raw.get("hf_trainer") if isinstance(raw, dict) else None
        stated = hf.get("privacy") if isinstance(hf, dict) else None
        return (
            isinstance(stated, str)
            and context.get("engine_privacy_config_sha256") == hashlib.sha256(stated.encode()).hexdigest()
        )

    def read_state(self) -> dict:
        """state.json's content ({} when absent).

        Raises:
            UserError: the file is damaged (naming it)."""
        if not self.state.is_file():
            return {}
        state = read_json(self.state)
        if not isinstance(state, dict):
            raise UserError(f"{self.state}: not a run state (expected a JSON object)")
        return state

    def write_state(self, **updates) -> dict:
        state = self.read_state()
        state.update(updates)
        write_json(self.state, state)
        return state

    def read_metrics(self) -> list[dict]:
        return _read_rows(self.metrics)

    def read_diagnostics(self) -> list[dict]:
        return _read_rows(self.diagnostics)


def _read_rows(path: Path) -> list[dict]:
    """The JSON lines of ``path`` ([] when absent; a torn last line after a crash is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line after a crash
                continue
    return rows


def check_metrics_cite_journal(rd: RunDir) -> int:
    """Every metrics.jsonl line cites the ledger journal's head after its step: the journal must
    still hold each (it was not cut back or replaced by an older copy). Returns the steps begun.

    Raises:
        UserError: naming the journal and metrics.jsonl."""
    journal = rd.checkpoints / JOURNAL
    header, hashes, begun = read_chain(journal)
    for row in rd.read_metrics():
        cited = row.get("journal") if isinstance(row, dict) else None
        if cited is not None:
            check_cited(journal, hashes, header.get("run"), cited, f"{rd.metrics} (step {row.get('step')})")
        elif isinstance(row, dict) and int(row.get("step", 0) or 0) > begun:
            raise UserError(
                f"{journal}: it records {begun} steps begun but {rd.metrics} records step "
                f"{row.get('step')}: the journal was truncated; the ledger cannot be trusted"
            )
    return begun


def verify_files(rd: RunDir) -> None:
    """Every file a report or an evaluation reads back is checked against its manifest: the
    committed checkpoint (``checkpoints/MANIFEST.json``) and the released model and adapter
    (``model/MANIFEST.json``, ``adapter/MANIFEST.json``, written after they are saved).

    Raises:
        UserError: naming the first file that is missing or differs, or a missing manifest."""
    ck = rd.checkpoints
    if (ck / MANIFEST).is_file() or (ck / "checkpoint.pt").is_file():
        verify_manifest(ck, accept_pending=True)
    for d in (rd.model, rd.adapter):
        if d.is_dir():
            verify_manifest(d)


def new_run_dir(output: str | os.PathLike | None) -> RunDir:
    """``output`` if given (created; must be empty or absent), else ``runs/<UTC timestamp>``."""
    if output is None:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S")
        root = Path.cwd() / "runs" / stamp
        i = 1
        while root.exists():
            root = Path.cwd() / "runs" / f"{stamp}-{i}"
            i += 1
    else:
        root = Path(output)
        if root.exists() and not root.is_dir():
            raise UserError(f"--output {output}: exists and is not a folder")
        if root.exists() and any(root.iterdir()):
            raise UserError(f"--output {output}: directory exists and is not empty (use --resume to continue a run)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"--output {root}: cannot write there ({exc.strerror or exc})") from None
    return RunDir(root)


def existing_run_dir(path: str | os.PathLike) -> RunDir:
    """The run directory at ``path``, or the evidence of a release bundle there (``userdp export``).

    Raises:
        UserError: neither (no config.yaml)."""
    root = Path(path)
    if not (root / "config.yaml").is_file() and (root / BUNDLE_EVIDENCE / "config.yaml").is_file():
        return RunDir(root / BUNDLE_EVIDENCE, model_root=root)
    if not (root / "config.yaml").is_file():
        raise UserError(f"{path}: not a userdp run directory (no config.yaml)")
    return RunDir(root)


def read_json(path: Path):
    """The JSON content of ``path``.

    Raises:
        UserError: the file cannot be read or is not JSON (naming it)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({type(exc).__name__}); the file is damaged") from None


def plot_curves(metrics: list[dict], out: Path) -> Path | None:
    """PNG with the training loss and the epsilon spent against step."""
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    a1.plot(steps, [m.get("loss") for m in metrics], lw=1)
    a1.set_xlabel("step")
    a1.set_ylabel("training loss (mean over sampled units)")
    if any(m.get("epsilon") is not None for m in metrics):
        a2.plot(steps, [float(m["epsilon"]) if m.get("epsilon") is not None else None for m in metrics], color="C3")
    a2.set_xlabel("step")
    a2.set_ylabel("epsilon spent")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""The release bundle of a run (``userdp export RUN DEST``, ``PrivateTrainer.push_to_hub()``):
exactly what may be published, laid out as the Hugging Face Hub expects a model repository.

```
<DEST>/
  README.md, config.json, model.safetensors, tokenizer files, MANIFEST.json
                        the released model (the run's model/ folder) and its card
  adapter/              the LoRA adapter, where the run saved one
  userdp/               the evidence `userdp report DEST` verifies: privacy.json, report.md,
                        report.json, config.yaml, metrics.jsonl, eval.json, plan.json, state.json,
                        checkpoints/ledger_journal.jsonl, ledger_head.json, ledger.json
```

Only public files (docs/threat_model.md, "Which files of a run are released") are copied, and only
those the statement rests on: never the records (``cache/``), the un-noised diagnostics, the
engine's resume state or intermediate checkpoints' weights, the Trainer's ``checkpoint-N/``. The run
is verified first (an edited or unverifiable run is not exported), the bundle is written beside
DEST and renamed into place (nothing half-written is left), then verified again as a bundle.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from userdp.engine.journal import HEAD, JOURNAL
from userdp.errors import UserError
from userdp.lm.report import write_report
from userdp.lm.run_dir import BUNDLE_EVIDENCE, existing_run_dir

#: the run's files the bundle's evidence holds (where they exist), relative to the run
EVIDENCE = (
    "privacy.json",
    "report.md",
    "report.json",
    "config.yaml",
    "metrics.jsonl",
    "eval.json",
    "plan.json",
    "state.json",
    f"checkpoints/{JOURNAL}",
    f"checkpoints/{HEAD}",
    "checkpoints/ledger.json",
)


def export_release(run: str | Path, dest: str | Path) -> Path:
    """Write the release bundle of the run at ``run`` into ``dest`` (absent or empty) and return it.

    Raises:
        UserError: the run does not verify (``userdp report``'s line), has no released model, or
            ``dest`` is taken."""
    rd = existing_run_dir(run)
    if rd.model_root is not None:
        raise UserError(f"{run}: already a release bundle; export a run directory")
    write_report(rd.root)  # the run verifies, and its card states the verified guarantee
    if not (rd.model / "config.json").is_file():
        raise UserError(f"{rd.model}: the run has no released model to export")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest}: exists and is not an empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        shutil.copytree(rd.model, tmp, dirs_exist_ok=True)
        if rd.adapter.is_dir():
            shutil.copytree(rd.adapter, tmp / "adapter")
        for rel in EVIDENCE:
            src = rd.root / rel
            if src.is_file():
                (tmp / BUNDLE_EVIDENCE / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tmp / BUNDLE_EVIDENCE / rel)
        write_report(tmp)  # the bundle verifies on its own: nothing it needs was left behind
        if dest.exists():
            dest.rmdir()
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest

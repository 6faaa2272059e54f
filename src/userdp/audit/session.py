"""One audited training run: canaries in, scores and bounds out (``audit.canaries > 0``).

The train job (:mod:`userdp.lm.finetune`) calls, in order:

1. :meth:`AuditSession.attach` after the datasets are built and before the first step: draws
   (or, on ``--resume``, re-derives) the canaries, scores them and a sample of real users under
   the starting model, writes the secrets file, and returns the training data with the included
   canaries appended as users;
2. :meth:`AuditSession.journal_context` binds the run's ledger journal to the canary draw, so a
   resume without the same canaries is refused;
3. :meth:`AuditSession.finish` after the last step: scores under the trained model, the one-run
   lower bound beside the accounted epsilon, and the user-inference diagnostic. Returns the
   public section for ``privacy.json``; the per-canary scores stay in the secrets file.

The secrets file (mode 0600, ``audit.secrets`` or ``<run_dir>.audit-secrets.json`` beside the run
directory, never inside it) holds the seed, which canaries were included, and every score.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from userdp.audit import bounds as B
from userdp.audit import scores as S
from userdp.audit.canaries import (
    Canaries,
    GradientCanaries,
    WithCanaries,
    gradient_canary_loss,
    new_seed,
    ordinary_token_ids,
)
from userdp.errors import UserError
from userdp.fileio import read_input, write_json
from userdp.lm.run_dir import existing_run_dir, read_json

DESIGN = (
    "one-run audit (Steinke, Nasr & Jagielski 2023): {k} synthetic canary users, each holding "
    "{r} copies of its own random {s}-token secret, were each included in the training data "
    "independently with probability 1/2 before training; after training the auditor guesses "
    "members from the scores alone"
)
GRADIENT_DESIGN = (
    "one-run audit (Steinke, Nasr & Jagielski 2023), white-box: {k} synthetic canary users, "
    "each holding {r} text-free records whose update is a large step along one coordinate "
    "of its own, were each included independently with probability 1/2 before training; "
    "every step's noisy update is read at the canaries' coordinates"
)
SCORES = {
    "loss": ("minus the secret's mean next-token loss under the trained model (black-box: the final model only)"),
    "loss_difference": (
        "the secret's mean next-token loss under the starting model minus under the "
        "trained model (black-box: the final model only)"
    ),
    "gradient_alignment": (
        "how far training moved the weights along the canary's gradient at the "
        "starting weights, <g, theta_0 - theta_T>/||g|| (white-box: the starting and "
        "final weights, as anyone holding the checkpoints has)"
    ),
    "gradient": (
        "gradient-space canaries: each canary's update is {scale:g} (far above C) along one "
        "coordinate of {param} of its own; the score is minus the sum over every step of the noisy "
        "update at that coordinate (white-box: the adversary who sees every step's update, which "
        "the guarantee covers)"
    ),
}
SHOWS = (
    "a lower bound that holds with the stated confidence over the canary draw and the training "
    "randomness: no (eps, delta)-DP guarantee with eps below it can be true of this run. A bound "
    "above the accounted epsilon means the implementation or its accounting is broken"
)
DOES_NOT_SHOW = (
    "that the accounted epsilon is tight or that real users are safer than the bound: "
    "a small lower bound only says this attack ({attack}) did not find more. Canaries "
    "are worst-case-like users; real users' text is less distinctive"
)
ATTACKS = {
    "gradient": "gradient-space canaries read at every step",
    "loss": "the final model's loss on random-token canaries",
    "loss_difference": "the final model's loss, against the starting model's, on random-token canaries",
    "gradient_alignment": "the final weights' movement along random-token canaries' gradients",
}
UI_NOTE = (
    "user inference (Kandpal et al. 2023): the same loss difference averaged over up to {rec} "
    "records of {nt} training users and {nh} held-out users; a diagnostic computed WITHOUT noise on "
    "real users' records (released outside the guarantee; see not_accounted). Training users' "
    "scored records may be ones the model trained on, which favours the attack"
)


def default_secrets_path(run_root: Path) -> Path:
    """``<run_dir>.audit-secrets.json``, beside the run directory (outside its public outputs)."""
    run_root = Path(run_root).resolve()
    return run_root.parent / f"{run_root.name}.audit-secrets.json"


def _write_private_json(path: Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically with mode 0600."""
    write_json(path, obj, indent=1, private=True)


class AuditSession:
    """The audit of one training run (see the module docstring).

    Args:
        audit_cfg: the ``audit:`` section (``userdp.lm.config.AuditConfig``).
        run_root: the run directory.
        resume: continue an audited run: its secrets file is read (it must exist when
            ``steps_begun``; a run stopped before its first step may start afresh).
        log: progress lines.
        steps_begun: whether the resumed run's ledger has begun a step.

    Raises:
        UserError: the secrets file exists for a new run, or is missing/damaged on a resume.
    """

    def __init__(
        self, audit_cfg, run_root: Path, *, resume: bool, log: Callable[[str], None], steps_begun: bool = True
    ):
        self.cfg = audit_cfg
        self.path = Path(audit_cfg.secrets) if audit_cfg.secrets else default_secrets_path(run_root)
        if self.path.resolve().is_relative_to(Path(run_root).resolve()):
            raise UserError(
                f"audit.secrets {self.path}: inside the run directory {run_root}, which is meant to be "
                "shared; the canaries' seed and inclusions must live outside it"
            )
        self.log = log
        self.state: dict = {}
        self.canaries: Canaries | None = None
        self._wrote = False
        if resume and (steps_begun or self.path.exists()):
            try:
                self.state = json.loads(self.path.read_text())
                int(self.state["seed"], 16)
            except FileNotFoundError:
                raise UserError(
                    f"{self.path}: the audit's secrets file is missing, so the canaries of this "
                    "run cannot be re-derived; the run cannot be resumed as an audit"
                ) from None
            except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
                raise UserError(f"{self.path}: not an audit secrets file written by userdp") from None
        elif self.path.exists():
            raise UserError(
                f"{self.path}: an audit secrets file is already there (another run's); "
                "move it away or set audit.secrets to a new path"
            )

    # ---------------------------------------------------------------- before training

    @property
    def gradient(self) -> bool:
        """Whether the canaries are gradient-space canaries (``audit.score: gradient``)."""
        return self.cfg.score == "gradient"

    def plan(self, plan):
        """The run plan the job trains by: ``plan`` itself (the audit's own tests hand it a broken
        part here: :func:`userdp.audit.faults.broken_session`)."""
        return plan

    def loss(self, loss_fn):
        """The training loss: ``loss_fn`` itself, or with the gradient canaries' term."""
        if not self.gradient:
            return loss_fn
        return gradient_canary_loss(loss_fn, self.canaries.param, self.canaries.scale)

    def observe_step(self, model) -> None:
        """Read this step's noisy update at every gradient canary's coordinate (after the step,
        before the next frees it) and keep the running scores in the secrets file."""
        if not self.gradient:
            return
        p = model.get_parameter(self.canaries.param)
        if p.grad is None:
            return
        vals = p.grad.detach().reshape(-1)[torch.from_numpy(self.canaries.coords).to(p.grad.device)]
        self.grad_scores -= vals.double().cpu().numpy()
        self.state["grad_scores"] = self.grad_scores.tolist()
        self.state["steps_observed"] = int(self.state.get("steps_observed", 0)) + 1
        _write_private_json(self.path, self.state)

    def _gradient_canaries(self, model, seed: int, clip_norm: float) -> GradientCanaries:
        """The gradient canaries on the model's largest trainable tensor (float32 or wider)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        param, w = max(named, key=lambda x: x[1].numel())
        if w.dtype not in (torch.float32, torch.float64):
            # the engine then updates float32 master copies: the model's own .grad stays empty
            raise UserError(
                f"audit.score: gradient canaries read each step's update on the model's weights, "
                f"but {param} is {str(w.dtype).replace('torch.', '')} (the update goes to separate "
                "master weights); load the model in float32 or use audit.score: loss"
            )
        scale = float(self.cfg.gradient_scale) * float(clip_norm)
        return GradientCanaries.generate(seed, int(self.cfg.canaries), self.records, param, w.numel(), scale)

    def attach(self, train_data, eval_data, tok, model, run_cfg):
        """The training data with the included canaries appended (see the module docstring).

        Args:
            train_data, eval_data: the training and held-out users' ``UserData``.
            tok: the tokenizer (secrets are drawn from its ordinary tokens).
            model: the starting model (scored now; on a resume, not used).
            run_cfg: the run's config (``userdp.lm.config.RunConfig``): its ``training.group_size``
                is the default records per canary, its ``tokenizer.seq_len`` the default and
                largest secret length, its ``training.clip_norm`` what a gradient canary's update
                is ``gradient_scale`` times.
        """
        group_size, seq_len = run_cfg.training.group_size, run_cfg.tokenizer.seq_len
        clip_norm = run_cfg.training.clip_norm
        self.records = int(self.cfg.records_per_canary or group_size)
        self.length = int(self.cfg.secret_tokens or seq_len)
        if self.length > seq_len:
            raise UserError(f"audit.secret_tokens = {self.length} is longer than tokenizer.seq_len = {seq_len}")
        if self.state:  # a resume: the same canaries, from the saved seed
            if (self.state.get("canaries"), self.state.get("records_per_canary"), self.state.get("secret_tokens")) != (
                int(self.cfg.canaries),
                self.records,
                self.length,
            ):
                raise UserError(f"{self.path}: its canaries do not match this run's audit settings")
            seed = int(self.state["seed"], 16)
        else:
            seed = new_seed() if self.cfg.seed is None else int(self.cfg.seed)
        if self.gradient:
            self.canaries = self._gradient_canaries(model, seed, clip_norm)
            self.grad_scores = np.asarray(
                self.state.get("grad_scores") or np.zeros(self.canaries.count), dtype=np.float64
            )
            what = (
                f"gradient canary users ({self.records} records each, update {self.canaries.scale:g} on "
                f"one coordinate of {self.canaries.param})"
            )
        else:
            self.canaries = Canaries.generate(
                seed, int(self.cfg.canaries), self.length, self.records, ordinary_token_ids(tok)
            )
            # the starting weights, for the white-box alignment score (on a resume the checkpoint is
            # loaded later, so the model is still the starting model here)
            self.start = S.trainable_snapshot(model)
            what = f"canary users of {self.records} records ({self.length}-token secrets)"
        view = WithCanaries(train_data, self.canaries.training_users(self._width(train_data)))
        if self.state:
            self.log(
                f"audit: resuming with the {self.canaries.count} canaries of {self.path}"
                + (f" ({self.state.get('steps_observed', 0)} steps observed)" if self.gradient else "")
            )
            return view
        self.log(
            f"audit: {self.canaries.count} {what}, {int(self.canaries.included.sum())} drawn into training; "
            f"seed and scores in {self.path} (keep it out of the published outputs)"
        )
        t0 = time.perf_counter()
        before = np.zeros(self.canaries.count) if self.gradient else S.canary_losses(model, self.canaries)
        ui = {}
        n_ui = int(self.cfg.inference_users)
        if n_ui > 0:
            # the choice of users to score is the auditor's, not secret: a fixed generator
            rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{seed:x}-ui".encode()).digest()[:8], "big"))
            tr = S.pick_users(train_data.num_users, n_ui, rng)
            he = S.pick_users(eval_data.num_users, n_ui, rng)
            rec = int(self.cfg.inference_records)
            tr_loss, tr_rec = S.user_losses(model, train_data, tr, rec, rng=rng)
            he_loss, he_rec = S.user_losses(model, eval_data, he, rec, rng=rng)
            ui = {
                "trained_users": tr.tolist(),
                "trained_records": [r.tolist() for r in tr_rec],
                "heldout_users": he.tolist(),
                "heldout_records": [r.tolist() for r in he_rec],
                "trained_before": tr_loss.tolist(),
                "heldout_before": he_loss.tolist(),
            }
        self.state = {
            "format": "userdp-audit-secrets-1",
            "seed": f"{seed:032x}",
            "canaries": self.canaries.count,
            "records_per_canary": self.records,
            "secret_tokens": self.length,
            "included": self.canaries.included.tolist(),
            "loss_before": before.tolist(),
            "user_inference": ui,
            "kind": "gradient" if self.gradient else "secret",
            "seconds_before_training": round(time.perf_counter() - t0, 3),
        }
        if self.gradient:
            self.state.update(
                param=self.canaries.param,
                scale=self.canaries.scale,
                grad_scores=self.grad_scores.tolist(),
                steps_observed=0,
            )
        _write_private_json(self.path, self.state)
        self._wrote = True
        return view

    @staticmethod
    def _width(data) -> int:
        return int(getattr(data, "seq_len", 0) or 0)

    def journal_context(self) -> dict:
        """What the ledger journal is bound to: a digest of the seed (reveals nothing of it)."""
        return {"audit_canaries": hashlib.sha256(self.state["seed"].encode()).hexdigest()[:32]}

    def discard(self) -> None:
        """Remove the secrets file this session wrote (the run failed before its first step)."""
        if self._wrote:
            self.path.unlink(missing_ok=True)

    # ---------------------------------------------------------------- after training

    def finish(self, model, train_data, eval_data, *, epsilon: float | None, delta: float) -> dict:
        """Score, bound and record; returns the public ``audit`` section of ``privacy.json``."""
        c = self.canaries
        t0 = time.perf_counter()
        if self.gradient:
            after = np.zeros(c.count)
            all_scores = {"gradient": self.grad_scores.copy()}
        else:
            after = S.canary_losses(model, c)
            before = np.asarray(self.state["loss_before"])
            # every score is computed and kept in the secrets file; only the configured one (chosen
            # before training) gives the bound — picking the best afterwards would need a union bound
            all_scores = {
                "loss": -after,
                "loss_difference": before - after,
                "gradient_alignment": S.gradient_alignment(model, c, self.start),
            }
        score = all_scores[self.cfg.score]
        inc = c.included
        conf = float(self.cfg.confidence)
        one = B.one_run_bound(score, inc, delta=delta, confidence=conf)
        cp = B.clopper_pearson_bound(score, inc, delta=delta, confidence=conf)
        out = {
            "design": (
                GRADIENT_DESIGN.format(k=c.count, r=self.records)
                if self.gradient
                else DESIGN.format(k=c.count, r=self.records, s=self.length)
            ),
            "canaries": c.count,
            "canaries_included": int(inc.sum()),
            "records_per_canary": self.records,
            "secret_tokens": self.length,
            "score": f"{self.cfg.score}: "
            + (SCORES["gradient"].format(scale=c.scale, param=c.param) if self.gradient else SCORES[self.cfg.score]),
            "epsilon_upper_bound": epsilon,
            "delta": delta,
            "confidence": conf,
            "epsilon_lower_bound": one.epsilon_lower_bound,
            "guesses": one.guesses,
            "correct": one.correct,
            "k_plus": one.k_plus,
            "k_minus": one.k_minus,
            "guess_grid": len(one.tried),
            "canary_auc": B.roc_auc(score[inc], score[~inc]),
            "canary_auc_other_scores": {
                k: B.roc_auc(v[inc], v[~inc]) for k, v in all_scores.items() if k != self.cfg.score
            },
            "clopper_pearson_diagnostic": {
                **cp,
                "note": "treats the canaries of one run as independent "
                "trials, which they are not; a diagnostic, not a bound",
            },
            "shows": SHOWS,
            "does_not_show": DOES_NOT_SHOW.format(attack=ATTACKS[self.cfg.score]),
            "secrets_file": str(self.path),
            "seeded": self.cfg.seed is not None,
        }
        if self.gradient:
            out["steps_observed"] = int(self.state.get("steps_observed", 0))
        out["largest_possible_bound"] = B.largest_bound(c.count, delta=delta, confidence=conf)
        out["statement"] = statement(epsilon, one.epsilon_lower_bound, conf, out["largest_possible_bound"])
        out["mechanism_caught"] = epsilon is not None and one.epsilon_lower_bound > epsilon
        ui = self.state.get("user_inference") or {}
        if ui:
            tr_after, _ = S.user_losses(
                model,
                train_data,
                np.asarray(ui["trained_users"], np.int64),
                0,
                records=[np.asarray(r, np.int64) for r in ui["trained_records"]],
            )
            he_after, _ = S.user_losses(
                model,
                eval_data,
                np.asarray(ui["heldout_users"], np.int64),
                0,
                records=[np.asarray(r, np.int64) for r in ui["heldout_records"]],
            )
            s_tr = np.asarray(ui["trained_before"]) - tr_after
            s_he = np.asarray(ui["heldout_before"]) - he_after
            ui["trained_after"], ui["heldout_after"] = tr_after.tolist(), he_after.tolist()
            rec = max((len(r) for r in ui["trained_records"] + ui["heldout_records"]), default=0)
            out["user_inference"] = {
                "auc": B.roc_auc(s_tr, s_he),
                "tpr_at_1pct_fpr": B.tpr_at_fpr(s_tr, s_he, 0.01),
                "trained_users": len(s_tr),
                "heldout_users": len(s_he),
                "note": UI_NOTE.format(rec=rec, nt=len(s_tr), nh=len(s_he)),
            }
        out["seconds"] = round(
            float(self.state.get("seconds_before_training", 0.0)) + time.perf_counter() - t0, 3
        )  # scoring only; training is the run's
        self.state.update(
            loss_after=after.tolist(),
            score=score.tolist(),
            scores={k: v.tolist() for k, v in all_scores.items()},
            result=out,
        )
        _write_private_json(self.path, self.state)
        return out


def statement(eps_upper: float | None, eps_lower: float, confidence: float, power: float | None = None) -> str:
    """ "accounted eps <= 3.0; audited eps >= 0.4 (95%; this audit could have shown at most 2.1)"."""
    up = "no guarantee (non-private run)" if eps_upper is None else f"accounted ε ≤ {eps_upper:.3g}"
    most = f"; this audit could have shown at most ε = {power:.3g}" if power is not None else ""
    return f"{up}; audited ε ≥ {eps_lower:.3g} ({confidence:.0%}{most})"


def combine_runs(run_dirs: list[str], confidence: float | None = None) -> dict:
    """Pool the canaries of several audited runs into one bound.

    Each run has its own canaries, so each canary's coin flip touches one run only. The runs
    together are then (eps, delta)-DP with respect to every canary, whenever each run is (parallel
    composition), and Steinke et al.'s theorem applies to the pooled m canaries. The claim tested
    is the weakest of the runs' (largest eps and delta). The Clopper–Pearson bound on the pooled
    trials is a diagnostic: trials within one run are not independent.

    Args:
        run_dirs: audited run directories (their privacy.json name the secrets files).
        confidence: of the bound (default: the first run's).

    Returns:
        dict with ``epsilon`` (the largest accounted, None if any run is non-private),
        ``epsilon_lower_bound``, ``confidence``, ``delta``, ``canaries``, ``runs``, the guesses,
        ``clopper_pearson_diagnostic`` and ``statement``.

    Raises:
        UserError: fewer than 2 runs, a run that was not audited, or a missing secrets file.
    """
    if len(run_dirs) < 2:
        raise UserError("--combine: give at least 2 audited run directories")
    scores, included, deltas, epsilons, seeds = [], [], [], [], set()
    conf = confidence
    for d in run_dirs:
        rd = existing_run_dir(d)
        if not rd.privacy.is_file():
            raise UserError(f"--combine {d}: no privacy.json (the run has not finished)")
        a = (read_json(rd.privacy) or {}).get("audit")
        if not a:
            raise UserError(f"--combine {d}: this run was not audited")
        path = Path(a["secrets_file"])
        if not path.exists():
            raise UserError(f"--combine {d}: its audit secrets file {path} is missing (moved or deleted)")
        text = read_input(path, f"--combine {d}: audit secrets file {path}")
        try:
            sec = json.loads(text)
            sc, inc = sec["score"], sec["included"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"--combine {d}: cannot read its audit secrets file {path}") from None
        if sec["seed"] in seeds:
            raise UserError(f"--combine {d}: its canaries are those of another run given (the same seed)")
        seeds.add(sec["seed"])
        scores.extend(sc)
        included.extend(inc)
        deltas.append(float(a["delta"]))
        epsilons.append(a.get("epsilon_upper_bound"))
        conf = conf if conf is not None else float(a["confidence"])
    delta = max(deltas)
    eps = None if any(e is None for e in epsilons) else max(epsilons)
    one = B.one_run_bound(scores, included, delta=delta, confidence=conf)
    cp = B.clopper_pearson_bound(scores, included, delta=delta, confidence=conf)
    return {
        "runs": len(run_dirs),
        "canaries": len(scores),
        "canaries_included": int(sum(included)),
        "epsilon": eps,
        "delta": delta,
        "confidence": conf,
        "epsilon_lower_bound": one.epsilon_lower_bound,
        "guesses": one.guesses,
        "correct": one.correct,
        "mechanism_caught": eps is not None and one.epsilon_lower_bound > eps,
        "clopper_pearson_diagnostic": {**cp, "note": "pooled trials; independent across runs only"},
        "largest_possible_bound": B.largest_bound(len(scores), delta=delta, confidence=conf),
        "statement": statement(
            eps, one.epsilon_lower_bound, conf, B.largest_bound(len(scores), delta=delta, confidence=conf)
        ),
    }

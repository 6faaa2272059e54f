"""The papers' LLM trade-offs on real user-partitioned text (Charles et al. 2024 §5–6; Chua et al. 2024).

    python benchmarks/bench_tradeoffs.py --quick --json       # CI-size: minutes on a 2-core CPU
    python benchmarks/bench_tradeoffs.py --figures docs/figures/tradeoffs   # the full grid (hours on a CPU)

On the blogs corpus (6,000 bloggers, median 11 posts) and on Stack Exchange (main sites, median
2 records), at equal compute B (records per step) and a fixed number of steps T:

* **grid** — the held-out-user loss of ELS, ULS and DP-FedAvg for every epsilon in ``--eps`` and
  compute budget in ``--budgets``, beside the pretrained model and non-private fine-tuning with
  the same B and T. ELS takes G from the median heuristic and B expected records per step;
  ULS takes (cohort M, G) from Estimate-and-Double under B, the L(G) of which are measured once
  per corpus at the pretrained model (a disclosed non-private touch, as ``userdp plan``);
  FedAvg takes ULS's (M, G) and accounting, with two local epochs of SGD. sigma is calibrated to
  epsilon (delta = N^-1.1) by the engine.
* **els_group_sweep** (Fig. 4) — ELS for G in ``--els-gs`` at one epsilon and budget.
* **uls_heatmap** (Fig. 5/13) — ULS for every (M, G) with M·G <= the largest budget, with the
  Estimate-and-Double choice marked.
* **correlated_noise** — ULS with independent noise against ULS with banded matrix-factorization
  noise over ``--bands`` cyclic user groups (``sampling="cyclic_poisson", noise="bandmf"``), the
  same (M, G) from Estimate-and-Double under the first budget, the same steps (so the same users
  processed), every epsilon in ``--eps``; with the pretrained model and non-private fine-tuning at
  that budget, so each row gives its share of the non-private gain.
* **selection** (Chua et al. Table) — record selection random / longest / shortest /
  highest and lowest perplexity / random chunk, for ELS (group-privacy style: G records kept
  once) and ULS (user-wise DP-SGD: G records drawn every step).

Hyperparameters: the learning rate and clip norm are tuned on a **proxy corpus declared
public** — the users of the Stack Exchange meta sites (ULS at epsilon = 3, the middle budget,
the best held-out loss of a small grid) — as ``userdp tune --on public`` does; the private
corpora are not touched by tuning. The tokenizer and the model are trained on the meta sites'
text (declared public) and shared by every run. ``--quick`` skips the tuning (lr and clip
fixed, and it says so).

Rows (``--json``: one JSON list): ``dataset, kind, algorithm, epsilon, compute_budget, loss``
(held-out users, per token, mean over seeds), ``loss_seeds, seeds, group_size, cohort,
noise_multiplier, steps, model, params, device, seconds``. Figures (PNG) go to ``--figures``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("USERDP_SHARED_DATA", REPO.parent / "shared" / "data"))
SE = DATA / "stackexchange"
BLOGS = DATA / "blogs" / "blogs.jsonl.gz"
META = (
    "ai.meta",
    "alcohol.meta",
    "bicycles.meta",
    "conlang.meta",
    "cstheory.meta",
    "datascience.meta",
    "french.meta",
    "history.meta",
)


#: the optimizer every run steps with (``--optimizer``): "adam" (the default) or "sgd" (no momentum:
#: the prefix-sum workload banded MF noise is built for)
OPTIMIZER = "adam"


def _optimizer(lr: float):
    from userdp import engine as E

    return E.Adam(lr=lr) if OPTIMIZER == "adam" else E.SGD(lr=lr)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Corpus:
    """One corpus, prepared once: training and held-out users, the pretrained model, L(G)."""

    name: str
    cfg: object
    prep: object
    tok: object
    model: object
    start: dict
    train: object
    heldout: object
    pairs: tuple
    estimator: object
    accountant: str = "pld"  # planning's and training's (--accountant)
    plans: dict = field(default_factory=dict)
    data_by_selection: dict = field(default_factory=dict)


def _sets(name: str, a, public_file: Path) -> list[str]:
    common = [
        f"tokenizer.vocab_size={a.vocab}",
        f"tokenizer.seq_len={a.seq_len}",
        f"model.preset={a.model}",
        f"model.pretraining.steps={a.pretrain_steps}",
        "model.pretraining.batch_size=32",
        "data.heldout_users=0.1",
        f"data.max_eval_users={a.eval_users}",
        "output.plot=false",
    ]
    if name == "blogs":
        return (
            common
            + [
                "data.source=jsonl",
                f"data.path={BLOGS}",
                "data.user_field=user",
                "data.text_field=text",
                f"data.public_path={public_file}",
            ]
            + ([f"data.max_users={a.max_users}"] if a.max_users else [])
        )
    sites = "[" + ",".join(META) + "]"
    if name == "proxy":  # the meta sites' users: declared public, used to tune lr and clip
        return common + ["data.source=stackexchange", f"data.path={SE}", f"data.sites={sites}"]
    return common + ["data.source=stackexchange", f"data.path={SE}"]


def _public_file(out: Path) -> Path:
    """The meta sites' text as JSON lines, so that blogs pretrain on exactly Stack Exchange's public text."""
    from userdp.caches import fingerprint
    from userdp.data import acquire as A

    path = out / "public-se-meta.jsonl"
    if not path.is_file():
        src = A.stackexchange_source(str(SE), None, public=True)
        store = A.cached_store(src, "se-" + fingerprint(A.file_signature(SE), [s.name for s in src.sites]), _log)
        with open(path, "w") as f:
            for _, batch in store.iter_text_batches():
                for t in batch:
                    if t:
                        f.write(json.dumps({"text": t}) + "\n")
    return path


def _eval_pairs(data, per_user: int, seed: int = 0):
    """A fixed sample of at most ``per_user`` records of every held-out user (bounds the cost of
    prolific users; the same records for every run)."""
    rng = np.random.default_rng(seed)
    users, recs = [], []
    for u, n in enumerate(data.sizes()):
        r = np.sort(rng.choice(int(n), size=min(int(n), per_user), replace=False))
        users.append(np.full(len(r), u))
        recs.append(r)
    return np.concatenate(users).astype(np.int64), np.concatenate(recs).astype(np.int64)


def prepare(name: str, a, public_file: Path) -> Corpus:
    import torch

    from userdp.devices import resolve_device
    from userdp.lm import config as C
    from userdp.lm import models
    from userdp.lm import prepare as F
    from userdp.lm.starting_model import get_tokenizer_and_model
    from userdp.planning import GradientNormEstimator, NormSample

    cfg = C.load_config(None, _sets(name, a, public_file))
    prep = F.prepare_data(cfg.data, _log)
    tok, model, _notes = get_tokenizer_and_model(
        cfg.tokenizer, cfg.model, prep, _log, progress=False, device=resolve_device(cfg.model.device)
    )
    model.train()
    train, heldout = F.build_datasets(
        prep, tok, seq_len=cfg.tokenizer.seq_len, selection=cfg.training.selection, log=_log
    )
    torch.manual_seed(0)
    est = GradientNormEstimator(
        model,
        train,
        models.causal_lm_loss,
        NormSample(a.lg_users, chunk_size=8),
        rng=np.random.default_rng(0),
        log=_log,
    )
    c = Corpus(
        name,
        cfg,
        prep,
        tok,
        model,
        copy.deepcopy(model.state_dict()),
        train,
        heldout,
        _eval_pairs(heldout, a.eval_records),
        est,
        accountant=a.accountant,
    )
    c.data_by_selection["random"] = train
    return c


def heldout_loss(c: Corpus) -> float:
    from userdp.lm.evaluate import record_nll, summarize

    u, r = c.pairs
    nll, cnt = record_nll(c.model, c.heldout, u, r, batch_size=64)
    return summarize(u, nll, cnt)["loss"]


def plan(c: Corpus, eps: float, budget: int, steps: int):
    from userdp.planning import PlanBudget, plan_for_budget

    key = (eps, budget, steps)
    if key not in c.plans:
        c.plans[key] = plan_for_budget(
            c.train.sizes(), PlanBudget(budget, eps, steps, accountant=c.accountant), c.estimator
        )
    return c.plans[key]


def selection_data(c: Corpus, selection: str):
    """The training view with another record selection (tokenized once, cached)."""
    import dataclasses

    from userdp.lm import prepare as F

    if selection not in c.data_by_selection:
        cfg = dataclasses.replace(c.cfg, training=dataclasses.replace(c.cfg.training, selection=selection))
        c.model.load_state_dict(c.start)
        c.data_by_selection[selection] = F.build_datasets(
            c.prep, c.tok, seq_len=cfg.tokenizer.seq_len, selection=selection, log=_log, model=c.model
        )[0]
    return c.data_by_selection[selection]


def train_eval(
    c: Corpus,
    algo: str,
    *,
    eps,
    steps,
    lr,
    clip,
    seed,
    group_size=None,
    cohort=None,
    budget=None,
    data=None,
    local_lr=0.1,
    bands=None,
) -> dict:
    """Fine-tune the pretrained model once; returns what was run and the held-out loss."""
    import torch

    from userdp import engine as E
    from userdp.lm import models

    c.model.load_state_dict(c.start)
    c.model.train()
    data = data if data is not None else c.train
    n_users = int(data.num_users)
    sizes = data.sizes()
    t0 = time.time()
    common = dict(
        steps=steps,
        optimizer=_optimizer(lr),
        delta=None,
        accountant=c.accountant,
        seed=None,
        performance=E.Performance(chunk_size=16, track_epsilon=False),
    )
    torch.manual_seed(seed)
    if algo == "nonprivate":  # records sampled from all of the data, no clipping, no noise, its own lr
        records = int(np.sum(sizes))
        cfg = E.TrainConfig(
            algorithm=E.ELS(int(sizes.max()), min(1.0, budget / records)),
            clipping=E.FlatClip(1e12),
            noise_multiplier=0.0,
            **common,
        )
        group_size, cohort = None, float(budget)
    elif algo == "els":
        dprime = int(np.minimum(sizes, group_size).sum())
        cfg = E.TrainConfig(
            algorithm=E.ELS(group_size, min(1.0, cohort / dprime)),
            clipping=E.FlatClip(clip),
            target_epsilon=eps,
            **common,
        )
    elif algo == "uls":
        # bands: users in b cyclic groups and banded MF noise (the same users a step: cohort / N overall)
        banded = dict(sampling="cyclic_poisson", noise="bandmf", bands=bands) if bands else {}
        cfg = E.TrainConfig(
            algorithm=E.ULS(group_size, min(1.0, cohort / n_users)),
            clipping=E.FlatClip(clip),
            target_epsilon=eps,
            **banded,
            **common,
        )
    elif algo == "fedavg":  # two local epochs of SGD on the user's G records; the clip scales with the delta
        cfg = E.TrainConfig(
            algorithm=E.FedAvg(
                group_size,
                min(1.0, cohort / n_users),
                local_epochs=2,
                local_lr=local_lr,
                local_batch_size=max(1, group_size // 2),
            ),
            clipping=E.FlatClip(clip * local_lr * 2 * math.ceil(group_size / max(1, group_size // 2))),
            target_epsilon=eps,
            **common,
        )
    else:
        raise ValueError(algo)
    res = E.train(c.model, data, models.causal_lm_loss, cfg)
    loss = heldout_loss(c)
    return {
        "loss": loss,
        "noise_multiplier": res.noise_multiplier,
        "epsilon_spent": res.epsilon,
        "accountant": c.accountant if algo != "nonprivate" else None,
        "group_size": group_size,
        "cohort": cohort,
        "seconds": time.time() - t0,
    }


def _row(c: Corpus, a, kind, algo, eps, budget, runs, **extra) -> dict:
    import torch

    losses = [r["loss"] for r in runs]
    first = runs[0]
    row = {
        "dataset": c.name,
        "kind": kind,
        "algorithm": algo,
        "epsilon": eps,
        "compute_budget": budget,
        "loss": float(np.mean(losses)),
        "loss_seeds": losses,
        "seeds": len(runs),
        "group_size": first.get("group_size"),
        "cohort": first.get("cohort"),
        "noise_multiplier": first.get("noise_multiplier"),
        "accountant": first.get("accountant"),
        "steps": a.steps,
        "model": a.model,
        "epsilon_spent": max((r.get("epsilon_spent") or 0.0) for r in runs) if eps is not None else None,
        "params": sum(p.numel() for p in c.model.parameters()),
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "seconds": round(sum(r.get("seconds", 0.0) for r in runs), 1),
    }
    row.update(extra)
    _log(
        f"{c.name:6s} {kind:15s} {algo:10s} eps={eps!s:5s} B={budget!s:4s} G={row['group_size']!s:4s} "
        f"M={row['cohort']!s:6s} loss {row['loss']:.4f}"
    )
    return row


def proxy_corpus(a, public_file: Path) -> Corpus:
    """The proxy corpus (the meta sites' users, declared public), prepared once per run: both
    tunings use it."""
    if getattr(a, "proxy", None) is None:
        a.proxy = prepare("proxy", a, public_file)
    return a.proxy


def tune(a, public_file: Path) -> tuple[float, float, float, list]:
    """lr and clip from the proxy corpus (declared public): ULS at epsilon 3, the middle budget;
    and the non-private baseline's own lr (no clip), so that it is not handicapped."""
    if a.quick:
        return a.lr, a.clip, a.lr_nonprivate, []
    proxy = proxy_corpus(a, public_file)
    b = a.budgets[len(a.budgets) // 2]
    p = plan(proxy, 3.0, b, a.steps)
    rows, best = [], None
    for lr in a.tune_lrs:
        for clip in a.tune_clips:
            r = train_eval(
                proxy,
                "uls",
                eps=3.0,
                steps=a.steps,
                lr=lr,
                clip=clip,
                seed=0,
                group_size=p.uls["group_size"],
                cohort=p.uls["cohort_size"],
            )
            rows.append(_row(proxy, a, "tuning", "uls", 3.0, b, [r], lr=lr, clip=clip))
            if best is None or r["loss"] < best[0]:
                best = (r["loss"], lr, clip)
    best_np = None
    for lr in a.tune_lrs_nonprivate:
        r = train_eval(proxy, "nonprivate", eps=None, steps=a.steps, lr=lr, clip=None, seed=0, budget=b)
        rows.append(_row(proxy, a, "tuning", "nonprivate", None, b, [r], lr=lr))
        if best_np is None or r["loss"] < best_np[0]:
            best_np = (r["loss"], lr)
    _log(
        f"tuned on the proxy (Stack Exchange meta users, declared public): lr {best[1]}, clip {best[2]}; "
        f"non-private lr {best_np[1]}"
    )
    return best[1], best[2], best_np[1], rows


def tune_fedavg(a, public_file: Path) -> tuple[float, list]:
    """FedAvg's local learning rate, on the same proxy (declared public) at epsilon 3 and the
    smallest budget FedAvg runs at, with the server's lr and the clip already tuned (the clip on
    the delta scales with the local lr and the local steps, as the docs recommend)."""
    if a.quick or "fedavg" not in a.algorithms or not set(a.fedavg_budgets) & set(a.budgets):
        return a.fedavg_lr, []
    proxy = proxy_corpus(a, public_file)
    b = min(set(a.fedavg_budgets) & set(a.budgets))
    p = plan(proxy, 3.0, b, a.steps)
    rows = [
        _row(
            proxy,
            a,
            "tuning",
            "fedavg",
            3.0,
            b,
            [
                train_eval(
                    proxy,
                    "fedavg",
                    eps=3.0,
                    steps=a.steps,
                    lr=a.lr,
                    clip=a.clip,
                    seed=0,
                    group_size=p.uls["group_size"],
                    cohort=p.uls["cohort_size"],
                    local_lr=llr,
                )
            ],
            local_lr=llr,
        )
        for llr in a.tune_local_lrs
    ]
    best = min(rows, key=lambda r: r["loss"])["local_lr"]  # the first of equal losses, as before
    _log(f"tuned on the proxy: FedAvg local lr {best}")
    return best, rows


def grid(c: Corpus, a) -> list[dict]:
    rows = [_row(c, a, "grid", "pretrained", None, None, [{"loss": heldout_loss(c)}])]
    seeds = range(a.seeds)
    for b in a.budgets:
        rows.append(
            _row(
                c,
                a,
                "grid",
                "nonprivate",
                None,
                b,
                [
                    train_eval(
                        c, "nonprivate", eps=None, steps=a.steps, lr=a.lr_nonprivate, clip=None, seed=s, budget=b
                    )
                    for s in seeds
                ],
                lr=a.lr_nonprivate,
            )
        )
        for eps in a.eps:
            p = plan(c, eps, b, a.steps)
            els = dict(group_size=p.els["group_size"], cohort=p.els["expected_batch_size"])
            uls = dict(group_size=p.uls["group_size"], cohort=p.uls["cohort_size"])
            for algo, kw in (("els", els), ("uls", uls), ("fedavg", uls)):
                if algo not in a.algorithms or (algo == "fedavg" and b not in a.fedavg_budgets):
                    continue
                extra = {"local_lr": a.fedavg_lr} if algo == "fedavg" else {}
                rows.append(
                    _row(
                        c,
                        a,
                        "grid",
                        algo,
                        eps,
                        b,
                        [
                            train_eval(c, algo, eps=eps, steps=a.steps, lr=a.lr, clip=a.clip, seed=s, **kw, **extra)
                            for s in seeds
                        ],
                        **extra,
                    )
                )
    return rows


def correlated(c: Corpus, a) -> list[dict]:
    """ULS with independent noise against ULS with banded MF noise over b cyclic groups, at the same
    (M, G), steps and epsilon; the pretrained and non-private rows of the same budget beside them."""
    b = a.budgets[0]
    seeds = range(a.seeds)
    rows = [_row(c, a, "correlated", "pretrained", None, None, [{"loss": heldout_loss(c)}])]
    nonprivate = [
        train_eval(c, "nonprivate", eps=None, steps=a.steps, lr=a.lr_nonprivate, clip=None, seed=s, budget=b)
        for s in seeds
    ]
    rows.append(_row(c, a, "correlated", "nonprivate", None, b, nonprivate, lr=a.lr_nonprivate))
    for eps in a.eps:
        p = plan(c, eps, b, a.steps)
        kw = dict(group_size=p.uls["group_size"], cohort=p.uls["cohort_size"])
        for bands in (None, *a.bands):
            runs = [
                train_eval(c, "uls", eps=eps, steps=a.steps, lr=a.lr, clip=a.clip, seed=s, bands=bands, **kw)
                for s in seeds
            ]
            name = "uls" if bands is None else f"uls_bandmf_b{bands}"
            rows.append(_row(c, a, "correlated", name, eps, b, runs, bands=bands or 1))
            _log(f"{c.name}: correlated eps={eps} {name}: loss {np.mean([r['loss'] for r in runs]):.4f}")
    return rows


def els_sweep(c: Corpus, a) -> list[dict]:
    b, eps = a.budgets[-1], a.sweep_eps
    median = plan(c, eps, b, a.steps).els["group_size"]
    rows = []
    for g in a.els_gs:
        r = train_eval(c, "els", eps=eps, steps=a.steps, lr=a.lr, clip=a.clip, seed=0, group_size=g, cohort=b)
        rows.append(_row(c, a, "els_group_sweep", "els", eps, b, [r], median_group_size=median))
    return rows


def uls_heatmap(c: Corpus, a) -> list[dict]:
    eps, top = a.sweep_eps, a.budgets[-1]
    choice = plan(c, eps, top, a.steps).uls
    rows = []
    for m in a.heat_ms:
        for g in a.heat_gs:
            if m * g > top or m > c.train.num_users:
                continue
            r = train_eval(c, "uls", eps=eps, steps=a.steps, lr=a.lr, clip=a.clip, seed=0, group_size=g, cohort=m)
            rows.append(
                _row(
                    c,
                    a,
                    "uls_heatmap",
                    "uls",
                    eps,
                    m * g,
                    [r],
                    estimate_and_double={"cohort": choice["cohort_size"], "group_size": choice["group_size"]},
                )
            )
    return rows


def selections(c: Corpus, a) -> list[dict]:
    from userdp.errors import UserError

    eps, b = a.sweep_eps, a.budgets[len(a.budgets) // 2]
    p = plan(c, eps, b, a.steps)
    rows = []
    for sel in a.selections:
        try:
            data = selection_data(c, sel)
        except UserError as exc:
            _log(f"selection {sel}: {exc}")
            continue
        for algo, kw in (
            ("els", dict(group_size=p.els["group_size"], cohort=p.els["expected_batch_size"])),
            ("uls", dict(group_size=p.uls["group_size"], cohort=p.uls["cohort_size"])),
        ):
            if sel == "random_chunk" and algo == "els":
                continue  # a chunk drawn afresh each step: user-wise training only (Chua et al.)
            r = train_eval(c, algo, eps=eps, steps=a.steps, lr=a.lr, clip=a.clip, seed=0, data=data, **kw)
            rows.append(_row(c, a, "selection", algo, eps, b, [r], selection=sel))
    return rows


def merge_repeats(rows: list[dict]) -> list[dict]:
    """Rows of the same cell from several runs (files) as one row: the losses of every repeat in
    ``loss_seeds``, their mean in ``loss``, their count in ``seeds``; the largest epsilon spent.
    Rows with other hyperparameters (lr, clip, FedAvg's local lr) are other cells, not repeats."""
    out: dict = {}
    for r in rows:
        key = tuple(
            r.get(k)
            for k in (
                "dataset",
                "kind",
                "algorithm",
                "epsilon",
                "compute_budget",
                "group_size",
                "cohort",
                "selection",
                "lr",
                "clip_norm",
                "local_lr",
            )
        )
        if key not in out:
            out[key] = dict(r, loss_seeds=list(r["loss_seeds"]))
            continue
        m = out[key]
        m["loss_seeds"] += list(r["loss_seeds"])
        m["seeds"] = len(m["loss_seeds"])
        m["loss"] = float(np.mean(m["loss_seeds"]))
        m["seconds"] = m.get("seconds", 0.0) + r.get("seconds", 0.0)
        spent = [x for x in (m.get("epsilon_spent"), r.get("epsilon_spent")) if x is not None]
        m["epsilon_spent"] = max(spent) if spent else None
        m["noise_multiplier"] = m.get("noise_multiplier") or r.get("noise_multiplier")
        m["recovered_from_log"] = bool(m.get("recovered_from_log") or r.get("recovered_from_log"))
    return list(out.values())


# ------------------------------------------------------------------------------------ figures
def figures(rows: list[dict], folder: Path, a) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    colors = {"els": "tab:blue", "uls": "tab:orange", "fedavg": "tab:green"}

    def save(fig, name: str) -> Path:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        return folder / name

    def meta(sub: list[dict]) -> str:
        r0 = sub[0]
        return (
            f"{r0['model']} GPT ({r0['params'] / 1e6:.2f}M params), T = {r0['steps']} steps, "
            f"seq {a.seq_len}, {r0['device']}, {max(r['seeds'] for r in sub)} seed(s), "
            f"{sum(r['seconds'] for r in sub) / 60:.0f} min of training"
        )

    for ds in sorted({r["dataset"] for r in rows if r["kind"] == "grid"}):
        g = [r for r in rows if r["dataset"] == ds and r["kind"] == "grid"]
        pre = next(r["loss"] for r in g if r["algorithm"] == "pretrained")
        for fig_name, outer, inner, xlab in (
            ("loss_vs_epsilon", "compute_budget", "epsilon", "epsilon"),
            ("loss_vs_compute", "epsilon", "compute_budget", "records per step B"),
        ):
            keys = sorted({r[outer] for r in g if r[outer] is not None})
            fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), squeeze=False)
            for ax, k in zip(axes[0], keys, strict=True):
                for algo in ("els", "uls", "fedavg"):
                    pts = sorted((r[inner], r["loss"]) for r in g if r["algorithm"] == algo and r[outer] == k)
                    if pts:
                        ax.plot(*zip(*pts, strict=True), "o-", color=colors[algo], label=algo.upper())
                ax.axhline(pre, color="gray", ls=":", label="pretrained")
                nps = [
                    r
                    for r in g
                    if r["algorithm"] == "nonprivate"
                    and (r["compute_budget"] == k if outer == "compute_budget" else True)
                ]
                if outer == "compute_budget" and nps:
                    ax.axhline(nps[0]["loss"], color="black", ls="--", label="non-private")
                elif nps:
                    ax.plot(
                        *zip(*sorted((r["compute_budget"], r["loss"]) for r in nps), strict=True),
                        "k--",
                        label="non-private",
                    )
                ax.set_xscale("log", base=2)
                ax.set_xlabel(xlab)
                ax.set_title(f"{'B' if outer == 'compute_budget' else 'epsilon'} = {k:g}")
                ax.set_ylabel("held-out loss / token")
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"{ds}: {meta(g)}", fontsize=9)
            out.append(save(fig, f"{ds}_{fig_name}.png"))
    for ds in sorted({r["dataset"] for r in rows if r["kind"] == "els_group_sweep"}):
        s = sorted(
            (r["group_size"], r["loss"], r["median_group_size"])
            for r in rows
            if r["dataset"] == ds and r["kind"] == "els_group_sweep"
        )
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        ax.plot([x[0] for x in s], [x[1] for x in s], "o-", color=colors["els"])
        ax.axvline(s[0][2], color="gray", ls=":", label=f"median heuristic G = {s[0][2]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ELS group size G")
        ax.set_ylabel("held-out loss / token")
        ax.legend(fontsize=7)
        sub = [r for r in rows if r["dataset"] == ds and r["kind"] == "els_group_sweep"]
        ax.set_title(
            f"{ds}: ELS group size (eps {sub[0]['epsilon']:g}, B {sub[0]['compute_budget']})\n{meta(sub)}", fontsize=7
        )
        out.append(save(fig, f"{ds}_els_group_size.png"))
    for ds in sorted({r["dataset"] for r in rows if r["kind"] == "uls_heatmap"}):
        h = [r for r in rows if r["dataset"] == ds and r["kind"] == "uls_heatmap"]
        ms, gs = sorted({r["cohort"] for r in h}), sorted({r["group_size"] for r in h})
        z = np.full((len(ms), len(gs)), np.nan)
        for r in h:
            z[ms.index(r["cohort"]), gs.index(r["group_size"])] = r["loss"]
        fig, ax = plt.subplots(figsize=(4.8, 3.8))
        im = ax.imshow(z, origin="lower", cmap="viridis_r")
        ax.set_xticks(range(len(gs)), [str(g) for g in gs])
        ax.set_yticks(range(len(ms)), [f"{m:g}" for m in ms])
        for i in range(len(ms)):
            for j in range(len(gs)):
                if not np.isnan(z[i, j]):
                    ax.text(j, i, f"{z[i, j]:.3f}", ha="center", va="center", fontsize=6, color="white")
        ed = h[0]["estimate_and_double"]
        if ed["cohort"] in ms and ed["group_size"] in gs:
            ax.plot(gs.index(ed["group_size"]), ms.index(ed["cohort"]), "s", mfc="none", mec="red", ms=18, mew=2)
        ax.set_xlabel("G (records per user per step)")
        ax.set_ylabel("cohort M (users per step)")
        ax.set_title(
            f"{ds}: ULS loss, eps {h[0]['epsilon']:g} (red: Estimate-and-Double at B = "
            f"{max(r['compute_budget'] for r in h)})\n{meta(h)}",
            fontsize=7,
        )
        fig.colorbar(im, ax=ax)
        out.append(save(fig, f"{ds}_uls_heatmap.png"))
    grid_rows = [r for r in rows if r["kind"] == "grid"]
    if grid_rows:  # the grid as a table: loss, and the share of the non-private gain recovered
        lines = [
            "| corpus | B | epsilon | ELS | ULS | FedAvg | non-private | pretrained | share of the non-private "
            "gain: ELS / ULS / FedAvg |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for ds in sorted({r["dataset"] for r in grid_rows}):
            g = [r for r in grid_rows if r["dataset"] == ds]
            pre = next(r["loss"] for r in g if r["algorithm"] == "pretrained")
            for b in sorted({r["compute_budget"] for r in g if r["compute_budget"] is not None}):
                npv = next((r["loss"] for r in g if r["algorithm"] == "nonprivate" and r["compute_budget"] == b), None)
                for eps in sorted({r["epsilon"] for r in g if r["epsilon"] is not None}):
                    cell = {r["algorithm"]: r["loss"] for r in g if r["compute_budget"] == b and r["epsilon"] == eps}
                    losses = [f"{cell[k]:.4f}" if k in cell else "—" for k in ("els", "uls", "fedavg")]
                    shares = [
                        f"{(pre - cell[k]) / (pre - npv):.0%}" if k in cell and npv is not None and pre > npv else "—"
                        for k in ("els", "uls", "fedavg")
                    ]
                    lines.append(
                        f"| {ds} | {b} | {eps:g} | "
                        + " | ".join(losses)
                        + f" | {npv:.4f} | {pre:.4f} | "
                        + " / ".join(shares)
                        + " |"
                    )
        p = folder / "grid_table.md"
        p.write_text("\n".join(lines) + "\n")
        out.append(p)
    sel = [r for r in rows if r["kind"] == "selection"]
    if sel:
        lines = ["| corpus | selection | ELS (group-privacy style) | ULS (user-wise) |", "|---|---|---|---|"]
        for ds in sorted({r["dataset"] for r in sel}):
            for s in a.selections:
                cell = {r["algorithm"]: r["loss"] for r in sel if r["dataset"] == ds and r["selection"] == s}
                if cell:
                    lines.append(
                        f"| {ds} | {s} | "
                        + " | ".join(f"{cell[k]:.4f}" if k in cell else "n/a" for k in ("els", "uls"))
                        + " |"
                    )
        p = folder / "selection_table.md"
        p.write_text("\n".join(lines) + "\n")
        out.append(p)
    corr = [r for r in rows if r["kind"] == "correlated"]
    if corr:
        p = folder / "correlated_table.md"
        p.write_text(correlated_table(corr))
        out.append(p)
    return out


def correlated_table(rows: list[dict]) -> str:
    """The head-to-head as Markdown: per corpus × epsilon × mechanism (× optimizer), the held-out
    loss (mean [min–max] over seeds), sigma, and the share of the non-private gain."""
    lines = [
        "| corpus | optimizer | ε | mechanism | σ | held-out loss (seeds) | share of the non-private gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for ds in sorted({r["dataset"] for r in rows}):
        for opt in sorted({r.get("optimizer", "adam") for r in rows if r["dataset"] == ds}):
            sub = [r for r in rows if r["dataset"] == ds and r.get("optimizer", "adam") == opt]
            pre = next(r["loss"] for r in sub if r["algorithm"] == "pretrained")
            npv = next(r["loss"] for r in sub if r["algorithm"] == "nonprivate")
            for eps in sorted({r["epsilon"] for r in sub if r["epsilon"] is not None}):
                for r in sorted((r for r in sub if r["epsilon"] == eps), key=lambda r: r.get("bands") or 1):
                    b = r.get("bands") or 1
                    name = "independent noise" if b == 1 else f"BandMF, b = {b}"
                    seeds = r["loss_seeds"]
                    lines.append(
                        f"| {ds} | {opt} | {eps:g} | {name} | {r['noise_multiplier']:.3f} | {r['loss']:.4f} "
                        f"[{min(seeds):.4f}–{max(seeds):.4f}] | {(pre - r['loss']) / (pre - npv):.1%} |"
                    )
            lines.append(f"| {ds} | {opt} | — | pretrained / non-private | — | {pre:.4f} / {npv:.4f} | 0% / 100% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI-size (minutes on a 2-core CPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON list of rows as the last line")
    ap.add_argument("--datasets", default="blogs,stackexchange")
    ap.add_argument("--parts", default="grid,els_group_sweep,uls_heatmap,selection")
    ap.add_argument("--figures", help="folder for the PNGs and the selection table (default: a temporary one)")
    ap.add_argument("--save", help="also write the rows to this JSON file")
    ap.add_argument("--seeds", type=int, help="seeds per grid cell (default 2; --quick 1)")
    ap.add_argument(
        "--eval",
        metavar="USERS,RECORDS",
        help="held-out users evaluated and records per user (default 150,16; --quick 40,4)",
    )
    ap.add_argument("--budgets", help="records per step B, comma-separated (default 16,32,64; --quick 8,16)")
    ap.add_argument("--steps", type=int, help="steps per run (default 80; --quick 6)")
    ap.add_argument("--epsilons", help="target epsilons of the grid, comma-separated (default 0.5,1,3,8; --quick 1,8)")
    ap.add_argument("--from-json", nargs="+", metavar="FILE", help="draw the figures from saved rows only")
    ap.add_argument(
        "--fedavg-budgets",
        help="the budgets at which FedAvg runs (default: all; its local SGD "
        "through per-user vmap is ~5x an ELS/ULS step on a CPU)",
    )
    ap.add_argument("--algorithms", default="els,uls,fedavg", help="the private algorithms of the grid")
    ap.add_argument("--bands", default="4,16", help="correlated_noise: the band counts b of BandMF (default 4,16)")
    ap.add_argument(
        "--optimizer",
        default="adam",
        choices=["adam", "sgd"],
        help="adam (default) or sgd without momentum (the prefix-sum workload banded MF noise is built for); "
        "sgd tunes lr in 0.3, 1, 3 on the proxy",
    )
    ap.add_argument(
        "--accountant",
        default="pld",
        choices=["pld", "rdp"],
        help="planning's and training's accountant (default pld; rdp: looser, and seconds instead "
        "of a minute of calibrations for a CI-size run)",
    )
    ap.add_argument("--fedavg-lr", type=float, help="FedAvg's local lr: skip its tuning on the proxy")
    ap.add_argument(
        "--tuned",
        metavar="LR,CLIP,LR_NONPRIVATE",
        help="skip the proxy tuning: use these (e.g. the values an earlier run's log printed)",
    )
    a = ap.parse_args(argv)
    if not a.from_json and (not SE.is_dir() or (("blogs" in a.datasets) and not BLOGS.is_file())):
        print(f"skip: the shared data ({DATA}) is absent", file=sys.stderr)
        if a.json:
            print("[]")
        return 0
    q = a.quick
    a.model, a.vocab, a.seq_len = "tiny", 2048, 64
    a.pretrain_steps = 20 if q else 600
    a.eval_users, a.eval_records = tuple(int(x) for x in a.eval.split(",")) if a.eval else (40, 4) if q else (150, 16)
    a.max_users = 600 if q else None
    a.lg_users = 16 if q else 128
    a.steps = a.steps or (6 if q else 80)
    a.eps = [float(x) for x in a.epsilons.split(",")] if a.epsilons else [1.0, 8.0] if q else [0.5, 1.0, 3.0, 8.0]
    a.budgets = [int(x) for x in a.budgets.split(",")] if a.budgets else ([8, 16] if q else [16, 32, 64])
    a.fedavg_budgets = [int(x) for x in a.fedavg_budgets.split(",")] if a.fedavg_budgets else a.budgets
    a.seeds = a.seeds or (1 if q else 2)
    a.algorithms = tuple(x for x in a.algorithms.split(",") if x)
    a.bands = [int(x) for x in a.bands.split(",") if x]
    if set(a.algorithms) - {"els", "uls", "fedavg"}:
        ap.error(f"--algorithms: one of els, uls, fedavg, not {a.algorithms}")
    a.tune_local_lrs = (0.01, 0.03, 0.1, 0.3)
    a.lr, a.clip, a.lr_nonprivate = 3e-3, 1.0, 1e-3
    a.tune_lrs, a.tune_clips, a.tune_lrs_nonprivate = (1e-3, 3e-3, 1e-2), (0.3, 1.0), (3e-4, 1e-3, 3e-3)
    global OPTIMIZER
    OPTIMIZER = a.optimizer
    if a.optimizer == "sgd":
        a.tune_lrs, a.tune_lrs_nonprivate = (0.3, 1.0, 3.0), (0.3, 1.0, 3.0)
    a.sweep_eps = 3.0
    a.els_gs = [1, 2, 4] if q else [1, 2, 4, 8, 16, 32]
    a.heat_ms = [2, 4] if q else [4, 8, 16, 32, 64]
    a.heat_gs = [1, 2, 4] if q else [1, 2, 4, 8, 16]
    a.selections = (
        ["random", "longest"] if q else ["random", "longest", "shortest", "highest_ppl", "lowest_ppl", "random_chunk"]
    )
    parts = set(a.parts.split(","))
    if a.from_json:
        rows = merge_repeats([r for f in a.from_json for r in json.loads(Path(f).read_text())])
        if a.save:
            Path(a.save).write_text(json.dumps(rows, indent=1))
        made = figures(rows, Path(a.figures or "."), a)
        _log(f"wrote {len(made)} figures/tables to {made[0].parent if made else '-'}")
        return 0
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench_tradeoffs_"))
    public = _public_file(work)
    if a.tuned:
        a.lr, a.clip, a.lr_nonprivate = (float(x) for x in a.tuned.split(","))
        rows = []
    else:
        a.lr, a.clip, a.lr_nonprivate, rows = tune(a, public)
    if a.fedavg_lr is None:
        a.fedavg_lr = 0.1  # --quick's untuned value
        a.fedavg_lr, more = tune_fedavg(a, public)
        rows += more
    for ds in [d for d in a.datasets.split(",") if d]:
        c = prepare(ds, a, public)
        for part, fn in (
            ("grid", grid),
            ("correlated_noise", correlated),
            ("els_group_sweep", els_sweep),
            ("uls_heatmap", uls_heatmap),
            ("selection", selections),
        ):
            if part in parts and (part != "selection" or ds == "blogs" or not q):
                rows += fn(c, a)
                if a.save:  # after every part: a long run stopped later keeps what it measured
                    Path(a.save).write_text(json.dumps(rows, indent=1))
    for r in rows:
        r["lr"], r["clip_norm"] = r.get("lr", a.lr), r.get("clip", None if r["algorithm"] == "nonprivate" else a.clip)
        r["tuned_on"] = "not tuned (--quick)" if q else "Stack Exchange meta-site users (declared public)"
        r["optimizer"] = a.optimizer
    made = figures(rows, Path(a.figures) if a.figures else work / "figures", a)
    _log(f"wrote {len(made)} figures/tables to {made[0].parent if made else '-'}; {time.time() - t0:.0f} s in all")
    if a.save:
        Path(a.save).write_text(json.dumps(rows, indent=1))
    if a.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(
                f"{r['dataset']:13s} {r['kind']:15s} {r['algorithm']:10s} eps {r['epsilon']!s:5s} "
                f"B {r['compute_budget']!s:4s} loss {r['loss']:.4f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Corpus statistics of a user-grouped store and the records-per-user histogram (paper Fig 10)."""

from __future__ import annotations

import numpy as np


def _summary(x: np.ndarray) -> dict:
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return {k: 0 for k in ("min", "median", "mean", "p90", "p99", "max")}
    return {
        "min": int(x.min()),
        "median": float(np.median(x)),
        "mean": float(x.mean()),
        "p90": float(np.percentile(x, 90)),
        "p99": float(np.percentile(x, 99)),
        "max": int(x.max()),
    }


def corpus_stats(store, tokenized=None) -> dict:
    """users, records, characters, tokens (with a ``full`` tokenization), per-user summaries, drops."""
    sizes = store.sizes()
    chars = store.record_chars()
    out = {
        "source": store.meta.get("source"),
        "users": int(store.num_users),
        "records": int(store.num_records),
        "characters": int(chars.sum()),
        "records_per_user": _summary(sizes),
        "characters_per_record": _summary(chars),
    }
    if tokenized is not None:
        lens = tokenized.seq_lengths()
        out["tokens"] = int(lens.sum())
        out["tokens_per_record"] = _summary(lens)
        per_user = np.add.reduceat(lens, tokenized.user_offsets[:-1]) if len(lens) else np.zeros(0)
        out["tokens_per_user"] = _summary(per_user)
    out["dropped"] = store.drops.to_dict()["counts"]
    out["drop_examples"] = store.drops.to_dict()["examples"]
    return out


def format_stats(s: dict) -> str:
    r = s["records_per_user"]
    lines = [
        f"source:     {s.get('source')}",
        f"users:      {s['users']:,}",
        f"records:    {s['records']:,}",
        f"characters: {s['characters']:,}",
    ]
    if "tokens" in s:
        lines.append(f"tokens:     {s['tokens']:,}")
    lines.append(
        (
            "records per user: min {min:,}  median {median:,.1f}  mean {mean:,.1f}  p90 {p90:,.1f}  "
            "p99 {p99:,.1f}  max {max:,}"
        ).format(**r)
    )
    if not s["dropped"]:
        lines.append("dropped: nothing")
    for k, v in sorted(s["dropped"].items()):
        ex = s.get("drop_examples", {}).get(k)
        lines.append(f"dropped {v:,}: {k}" + (f" (e.g. {ex[0]})" if ex else ""))
    return "\n".join(lines)


def plot_records_per_user(sizes: np.ndarray, path, title: str | None = None) -> None:
    """Histogram of records per user on log-log axes with log-spaced bins (like the paper's Fig 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = np.asarray(sizes)
    hi = max(2, int(sizes.max()) if len(sizes) else 2)
    bins = np.unique(np.round(np.logspace(0, np.log10(hi + 1), 40)).astype(int))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(sizes, bins=bins, color="#3b6ea5", edgecolor="white", linewidth=0.4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("records per user")
    ax.set_ylabel("users")
    med = float(np.median(sizes)) if len(sizes) else 0
    ax.axvline(max(med, 1), color="#c44", linestyle="--", linewidth=1, label=f"median {med:g}")
    ax.legend()
    ax.set_title(title or f"{len(sizes):,} users, {int(sizes.sum()):,} records")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

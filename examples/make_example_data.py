"""Write the small synthetic own-data example used by the README and examples/*.yaml.

    python examples/make_example_data.py     # rewrites examples/data/ (deterministic)

``commits.jsonl`` / ``commits.csv``: 80 authors (the users) with 1-30 commit messages each,
made from templates; ``public.txt``: paragraphs of generic software prose, declared public (it
trains the tokenizer and pretrains the model). Synthetic: no real person's text.
"""

import csv
import json
import random
from pathlib import Path

VERBS = ["fix", "add", "remove", "refactor", "update", "rename", "document", "test", "speed up", "simplify"]
THINGS = [
    "the parser",
    "login flow",
    "cache eviction",
    "the CLI help",
    "error messages",
    "retry logic",
    "config loading",
    "the build script",
    "unit tests",
    "logging",
    "the scheduler",
    "date handling",
]
WHY = [
    "so that it no longer crashes on empty input",
    "to match the new API",
    "after review comments",
    "because the old path leaked memory",
    "for the release",
    "to make the tests deterministic",
    "as discussed in the design doc",
    "to cut start-up time",
    "so errors name the bad field",
]
STYLE = [
    lambda v, t, w: f"{v} {t} {w}",
    lambda v, t, w: f"{v.capitalize()} {t}: {w}.",
    lambda v, t, w: f"[{t}] {v} ({w})",
    lambda v, t, w: f"{v} {t}\n\n{w.capitalize()}.",
]


def main(out: Path = Path(__file__).parent / "data") -> None:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for a in range(80):
        style = STYLE[a % len(STYLE)]  # each author writes in their own style
        favourite = rng.sample(THINGS, 3)
        for _ in range(max(1, int(rng.lognormvariate(1.8, 0.8)) % 30)):
            t = rng.choice(favourite if rng.random() < 0.7 else THINGS)
            rows.append({"author": f"dev{a:03d}", "message": style(rng.choice(VERBS), t, rng.choice(WHY))})
    with open(out / "commits.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(out / "commits.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["author", "message"])
        for r in rows:
            w.writerow([r["author"], r["message"]])
    paras = []
    for _ in range(300):
        paras.append(" ".join(f"{rng.choice(VERBS)} {rng.choice(THINGS)} {rng.choice(WHY)}." for _ in range(4)))
    (out / "public.txt").write_text("\n\n".join(paras) + "\n")


if __name__ == "__main__":
    main()

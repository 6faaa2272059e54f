"""Fingerprint of seeded runs: sha256 of the final parameters and the exact epsilon, for ELS, ULS
and FedAvg under flat, per-layer, adaptive and normalized clipping, Poisson and fixed-size/shuffle
sampling. A refactor that claims "behaviour unchanged" must print the same lines before and after.

    python benchmarks/fingerprint.py            # prints one line per case
    python benchmarks/fingerprint.py --check F  # compares with a saved output, exit 1 on a change
"""

import argparse
import hashlib
import sys

import numpy as np
import torch
from torch import nn

from userdp.engine import (
    ELS,
    SGD,
    ULS,
    Adam,
    AdaptiveClip,
    FedAvg,
    FlatClip,
    PerLayerClip,
    TensorUserData,
    TrainConfig,
    train,
)
from userdp.engine.aggregation import ClippedDenominator
from userdp.engine.performance import Performance


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def data():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 9, 40)
    n = int(sizes.sum())
    x = torch.from_numpy(rng.normal(size=(n, 6))).float()
    y = torch.from_numpy(rng.integers(0, 3, n))
    return TensorUserData({"x": x, "y": y}, np.concatenate([[0], np.cumsum(sizes)]))


CASES = {
    "els_flat": dict(algorithm=ELS(3, 0.2), clipping=FlatClip(1.0)),
    "uls_flat": dict(algorithm=ULS(4, 0.3), clipping=FlatClip(0.5)),
    "uls_perlayer": dict(algorithm=ULS(4, 0.3), clipping=PerLayerClip(1.0)),
    "uls_adaptive": dict(algorithm=ULS(4, 0.3), clipping=AdaptiveClip(0.1)),
    "uls_normalized_adam": dict(algorithm=ULS(2, 0.5), clipping=FlatClip(1.0, normalized=True), optimizer=Adam(1e-2)),
    "uls_clipped_den": dict(algorithm=ULS(4, 0.3), denominator=ClippedDenominator()),
    "fedavg": dict(algorithm=FedAvg(4, 0.3, local_epochs=2, local_lr=0.05, local_batch_size=2)),
    "fedavg_weighted_reproject": dict(algorithm=FedAvg(4, 0.3, weight_cap=3.0, reproject=True)),
    "uls_fixed_size": dict(algorithm=ULS(4, 0.25), sampling="fixed_size", accountant="rdp"),
    "els_shuffle": dict(algorithm=ELS(1, 0.1), sampling="shuffle"),
    "uls_calibrated": dict(algorithm=ULS(4, 0.3), noise_multiplier=None, target_epsilon=4.0),
    "els_rdp": dict(algorithm=ELS(2, 0.2), accountant="rdp"),
}


def run(name):
    kw = dict(steps=6, noise_multiplier=1.1, seed=1234, optimizer=SGD(0.5), performance=Performance(chunk_size=8))
    kw.update(CASES[name])
    model = MLP()
    res = train(model, data(), loss, TrainConfig(**kw))
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return f"{name} params={h.hexdigest()[:16]} eps={res.epsilon!r} z={res.noise_multiplier!r}"


def run_lm(algorithm):
    """The LM job end to end (tokenizer, pretraining on public text, fine-tuning), seeded."""
    import json
    import pathlib
    import random
    import tempfile

    from userdp.lm import config as C
    from userdp.lm.finetune import run as lm_run

    words = [
        "the",
        "king",
        "is",
        "dead",
        "long",
        "live",
        "the",
        "queen",
        "my",
        "lord",
        "I",
        "pray",
        "you",
        "speak",
        "of",
        "love",
        "and",
        "war",
        "to",
        "be",
        "or",
        "not",
        "to",
        "be",
        "that",
        "is",
        "the",
        "question",
    ]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        with open(d / "users.jsonl", "w") as f:
            for u in range(40):
                for _ in range(1 + u % 5):
                    f.write(json.dumps({"user": f"u{u}", "text": " ".join(rng.choice(words) for _ in range(9))}) + "\n")
        (d / "public.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(20)) for _ in range(60)))
        (d / "c.yaml").write_text(f"""
data: {{source: jsonl, path: {d / "users.jsonl"}, public_path: {d / "public.txt"}, heldout_users: 0.2}}
tokenizer: {{vocab_size: 300, seq_len: 16}}
model: {{preset: tiny, pretraining: {{steps: 6, batch_size: 8}}}}
privacy: {{epsilon: 8.0}}
training: {{algorithm: {algorithm}, steps: 4, cohort_size: 8, group_size: 2, lr: 0.001, seed: 7}}
output: {{cache: run}}
""")
        cfg = C.load_config(str(d / "c.yaml"))
        out = d / "run"
        lm_run(cfg, output=str(out), progress=False, log=lambda m: None)
        h = hashlib.sha256((out / "model" / "model.safetensors").read_bytes()).hexdigest()[:16]
        priv = json.loads((out / "privacy.json").read_text())
        return f"lm_{algorithm} model={h} eps={priv['epsilon']!r}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check")
    a = ap.parse_args()
    lines = [run(n) for n in CASES] + [run_lm(a) for a in ("uls", "els", "fedavg")]
    if a.check:
        want = open(a.check).read().split("\n")
        bad = [(w, g) for w, g in zip(want, lines, strict=True) if w != g]
        for w, g in bad:
            print(f"CHANGED\n  before {w}\n  after  {g}")
        print(f"{len(lines) - len(bad)}/{len(lines)} identical")
        sys.exit(1 if bad else 0)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

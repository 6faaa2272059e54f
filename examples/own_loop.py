"""User-level DP in your own training loop (runs in seconds).

`make_private` is the user-level counterpart of Opacus's `make_private`: you keep the model, the
optimizer, the learning-rate schedule and the loop; each step's `backward()` puts the privatized
gradient (Poisson user cohort, per-user clipped sum, Gaussian noise, public denominator) in
`p.grad`, after the ledger has counted the step. Task: a small classifier over 400 users.

    python examples/own_loop.py
"""

import numpy as np
import torch
from torch import nn

from userdp.engine import ULS, FlatClip, TensorUserData, TrainConfig, make_private


def loss_fn(model, batch):  # one loss per record (the engine vmaps it over users)
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def main():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 30, 400)  # records per user
    n = int(sizes.sum())
    w = rng.normal(size=(16, 4))
    x = rng.normal(size=(n, 16)).astype(np.float32)
    y = (x @ w + rng.gumbel(size=(n, 4))).argmax(1)
    data = TensorUserData({"x": torch.tensor(x), "y": torch.tensor(y)}, offsets=np.concatenate([[0], np.cumsum(sizes)]))
    hx = rng.normal(size=(2000, 16)).astype(np.float32)  # held-out people's records, never trained on
    held_x, held_y = torch.tensor(hx), torch.tensor((hx @ w + rng.gumbel(size=(2000, 4))).argmax(1))

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=60)
    config = TrainConfig(
        algorithm=ULS(group_size=8, sampling_rate=0.25),
        steps=60,
        clipping=FlatClip(1.0),
        target_epsilon=3.0,
        delta=1e-5,
    )

    with make_private(model, optimizer, data, loss_fn, config) as private:
        for step in private:
            optimizer.zero_grad()
            metrics = step.backward()  # the ledger counts the step first; then p.grad = the noisy mean
            optimizer.step()
            scheduler.step()
            if step.index % 20 == 0:
                print(
                    f"step {step.index:3d}  loss {metrics['loss']:.3f} (private, not for release)  "
                    f"eps <= {metrics['epsilon_spent']:.2f}  lr {scheduler.get_last_lr()[0]:.3f}"
                )
        record = private.record()
    with torch.no_grad():
        acc = (model(held_x).argmax(1) == held_y).float().mean()
    print(
        f"sigma {private.noise_multiplier:.3f}, q {private.sampling_rate:.2f}: epsilon = {private.epsilon():.3f} "
        f"at delta = {private.delta:g} ({record['stopped']}); at delta = 1e-7: {private.epsilon(1e-7):.3f}"
    )
    print(f"accuracy {float(acc):.3f}")


if __name__ == "__main__":
    main()

"""userdp engine quickstart: train any torch.nn.Module with user-level DP (runs in seconds).

Task: estimate the mean of 500 users' data (each user holds 1-20 records) with ULS, a
target epsilon, and the privacy record the run earned.

    python examples/engine_quickstart.py
"""

import numpy as np
import torch
from torch import nn

from userdp.engine import SGD, ULS, FlatClip, RunOptions, TensorUserData, TrainConfig, train


class Mean(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(dim))


def loss_fn(model, batch):  # one loss per record (the engine vmaps it over units)
    return 0.5 * ((model.theta - batch["x"]) ** 2).sum(-1)


def main():
    rng = np.random.default_rng(0)
    num_users, dim = 500, 8
    sizes = rng.integers(1, 21, num_users)  # records per user
    user_means = rng.normal(1.0, 0.5, (num_users, dim))
    x = np.concatenate([rng.normal(m, 1.0, (n, dim)) for m, n in zip(user_means, sizes, strict=True)])
    data = TensorUserData({"x": torch.tensor(x, dtype=torch.float32)}, offsets=np.concatenate([[0], np.cumsum(sizes)]))

    config = TrainConfig(
        algorithm=ULS(group_size=8, sampling_rate=0.1),  # users Poisson-sampled at q = 0.1
        steps=100,
        clipping=FlatClip(3.0),
        optimizer=SGD(lr=0.5),
        target_epsilon=2.0,  # sigma calibrated to (epsilon, delta) for these steps
        delta=1e-5,
    )
    model = Mean(dim)
    result = train(
        model,
        data,
        loss_fn,
        config,
        RunOptions(
            callbacks=[
                lambda m: (
                    m["step"] % 25 == 0
                    and print(
                        f"step {m['step']:3d}  loss {m['loss']:.3f}  eps<= {m['epsilon_spent']:.2f}  "
                        f"units {m['units']}  clipped {m['fraction_clipped']:.2f}"
                    )
                )
            ]
        ),
    )
    target = torch.tensor(user_means.mean(0), dtype=torch.float32)
    print(
        f"noise multiplier {result.noise_multiplier:.3f}; spent epsilon = {result.epsilon:.3f} "
        f"at delta = {result.delta:g} over {result.steps} steps ({result.record['sampler_mode']})"
    )
    print(f"error vs the mean of user means: {float((model.theta.detach() - target).norm()):.3f}")


if __name__ == "__main__":
    main()

"""Shared tiny models and data for the engine tests."""

import numpy as np
import torch
from torch import nn

from userdp.engine import TensorUserData


class Mean(nn.Module):
    """theta in R^d; loss 1/2 ||theta - x||^2 (the mean-estimation task)."""

    def __init__(self, d, init=None):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(d) if init is None else init.clone())


def sq_loss(model, batch):
    return 0.5 * ((model.theta - batch["x"]) ** 2).sum(-1)


def linear_loss(model, batch):
    """Gradient of one record = -x: lets a test choose every per-record gradient."""
    return -(model.theta * batch["x"]).sum(-1)


class MLP(nn.Module):
    def __init__(self, d_in=6, h=8, d_out=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.LayerNorm(h), nn.Linear(h, d_out))

    def forward(self, x):
        return self.net(x)


def ce_loss(model, batch):
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits, batch["y"], reduction="none")


def user_data(sizes, d=3, seed=0, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes)
    x = torch.from_numpy(rng.normal(shift, scale, (int(sizes.sum()), d))).float()
    return TensorUserData({"x": x}, np.concatenate([[0], np.cumsum(sizes)]))


def mlp_data(sizes, d=6, k=3, seed=0):
    rng = np.random.default_rng(seed)
    n = int(np.sum(sizes))
    x = torch.from_numpy(rng.normal(size=(n, d))).float()
    y = torch.from_numpy(rng.integers(0, k, n))
    return TensorUserData({"x": x, "y": y}, np.concatenate([[0], np.cumsum(sizes)]))

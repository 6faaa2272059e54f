"""The neighbour test's adversaries and its small regression model, shared by the suites that
run it (tests/guarantee/test_neighbour.py, tests/engine/test_ghost.py, test_lazy_zeroing.py):
records whose per-token gradients cancel, huge values, one record repeated, a user with many
records, non-finite values."""

import numpy as np
import torch
from torch import nn

from userdp.engine import TensorUserData

D_IN, D_OUT = 8, 4


class Reg(nn.Module):
    def __init__(self, layers=1):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D_IN, D_IN if i < layers - 1 else D_OUT) for i in range(layers))

    def forward(self, x):
        for lin in self.layers:
            x = lin(x)
        return x


def reg_loss(model, batch):
    return 0.5 * ((model(batch["x"]) - batch["t"]) ** 2).sum(-1)


def builder(layers=1, dtype=torch.float32):
    def build():
        torch.manual_seed(3)
        return Reg(layers).to(dtype)

    return build


def honest(n_users=6, g=2, dtype=torch.float32, seed=0):
    rng = np.random.default_rng(seed)
    n = n_users * g
    x = torch.from_numpy(rng.normal(size=(n, D_IN))).to(dtype)
    t = torch.from_numpy(rng.normal(size=(n, D_OUT))).to(dtype)
    return TensorUserData({"x": x, "t": t}, np.arange(0, n + 1, g))


def cancelling(big: float, dtype=torch.float32, records=2):
    """One user: ``records`` records with the same input and targets +M v, -M v, ... (+ K w on the
    last): the per-record gradients are huge and cancel, the user's gradient is small."""
    x = torch.ones(records, D_IN, dtype=dtype)
    v = torch.zeros(D_OUT, dtype=dtype)
    v[0] = 1.0
    w = torch.zeros(D_OUT, dtype=dtype)
    w[1] = 1.0
    t = torch.stack([(big if i % 2 == 0 else -big) * v for i in range(records)])
    t[-1] = t[-1] + w
    return TensorUserData({"x": x, "t": t}, np.array([0, records]))


ADVERSARIES = {
    "cancelling": lambda: cancelling(3e4),
    "cancelling_many": lambda: cancelling(1e4, records=8),
    "huge": lambda: TensorUserData(
        {"x": torch.full((2, D_IN), 1e15), "t": torch.full((2, D_OUT), -1e15)}, np.array([0, 2])
    ),
    "repeated": lambda: TensorUserData(
        {"x": torch.full((8, D_IN), 3.0), "t": torch.full((8, D_OUT), -5.0)}, np.array([0, 8])
    ),
    "many_records": lambda: TensorUserData(
        {
            "x": torch.randn(10_000, D_IN, generator=torch.Generator().manual_seed(1)) * 50,
            "t": torch.zeros(10_000, D_OUT),
        },
        np.array([0, 10_000]),
    ),
    "nonfinite": lambda: TensorUserData(
        {
            "x": torch.tensor([[float("inf")] * D_IN, [1.0] * D_IN]),
            "t": torch.tensor([[float("nan")] * D_OUT, [1.0] * D_OUT]),
        },
        np.array([0, 2]),
    ),
}

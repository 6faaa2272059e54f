"""One rank of the multi-process equality test (tests/e2e/test_torchrun.py), launched by torchrun.

``torchrun --standalone --nproc_per_node=W tests/_dist_worker.py OUT`` trains the same seeded
runs on W processes and saves, on every rank, the final parameters and the collectives it
issued (dtype and size of every all-reduce) to OUT/rank<r>.pt.
"""

import sys

import torch
import torch.distributed as dist

from userdp import world as launch
from userdp.engine import ELS, SGD, ULS, FedAvg, FlatClip, RunOptions, train
from userdp.engine.distributed.processes import combiner_for
from userdp.engine.user_data import DelegatingUserData

from _engine_helpers import MLP, ce_loss, mlp_data, train_config

SIZES = [3, 1, 5, 2, 8, 4, 6, 7] * 3  # G = 2 < most sizes: each step draws records at random


def configs():
    common = dict(
        steps=4,
        clipping=FlatClip(0.5),
        optimizer=SGD(0.5),
        noise_multiplier=1.3,
        delta=1e-5,
        seed=17,
        chunk_size=3,
        track_epsilon=False,
        accountant="rdp",
    )
    return {
        "uls": train_config(algorithm=ULS(2, 0.5), **common),
        "els": train_config(algorithm=ELS(2, 0.3), **common),
        "fedavg": train_config(algorithm=FedAvg(2, 0.5, local_epochs=2, local_lr=0.3), **common),
    }


class Recorded(DelegatingUserData):
    """Records the users whose records this process loads."""

    def __init__(self, inner):
        super().__init__(inner)
        self.loaded = []

    def draw_records(self, users, group_size, rng):
        self.loaded += [int(u) for u in users]
        return self.inner.draw_records(users, group_size, rng)


def run_all(combiner=None) -> dict:
    """{algorithm: final parameters}, plus "loaded_uls": the users this process loaded for ULS."""
    out = {}
    for name, cfg in configs().items():
        torch.manual_seed(0)
        model = MLP()
        data = Recorded(mlp_data(SIZES, seed=2))
        train(model, data, ce_loss, cfg, RunOptions(combiner=combiner))
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if name == "uls":
            out["loaded_uls"] = data.loaded
    return out


def main(out_dir: str) -> None:
    world = launch.init_world("cpu")
    issued = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        issued.append((str(tensor.dtype), tensor.numel()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        params = run_all(combiner_for(world.distributed))
    finally:
        dist.all_reduce = real
    torch.save(
        {"params": params, "all_reduce": issued, "world_size": world.world_size}, f"{out_dir}/rank{world.rank}.pt"
    )
    world.close()


if __name__ == "__main__":
    main(sys.argv[1])

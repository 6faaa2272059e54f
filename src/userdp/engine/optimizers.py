"""Optimizers that consume only the privatized gradient (post-processing, Ponomareva et al. 2023, Table 5).

Frozen dataclasses that build a ``torch.optim`` optimizer. The engine writes the privatized
estimate into ``p.grad`` and calls ``step()``; nothing else about the data reaches them.
For FedAvg the estimate is the averaged pseudo-gradient ``theta0 - theta_local``, so
``SGD(lr=1)`` is plain FedAvg and ``SGD(lr=eta_s, momentum=beta)`` is server momentum
(FedAvgM; ``dampening=beta`` gives the (1-beta) form of Andrew et al.).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from userdp.errors import UserError
from userdp.validation import check_bool, check_fields, check_nonnegative, check_number, check_positive, optional


def _unit_interval(value, name: str) -> float:
    x = check_nonnegative(value, name)
    if x >= 1:
        raise UserError(f"{name} must be in [0, 1) (got {value})")
    return x


def _betas(value, name: str) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UserError(f"{name} must be a pair of numbers in [0, 1) (got {value!r})")
    return (_unit_interval(value[0], name), _unit_interval(value[1], name))


def _eps_pair(value, name: str) -> tuple[float | None, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UserError(f"{name} must be a pair (eps1 or None, eps2) (got {value!r})")
    return (optional(check_positive)(value[0], name), check_positive(value[1], name))


@dataclass(frozen=True)
class SGD:
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        # a non-finite rate trains to nan and releases it: refused with the other bad values
        check_fields(
            self,
            lr=(check_positive, "SGD lr"),
            momentum=(_unit_interval, "SGD momentum"),
            dampening=(_unit_interval, "SGD dampening"),
            nesterov=(check_bool, "SGD nesterov"),
            weight_decay=(check_nonnegative, "SGD weight_decay"),
        )

    def build(self, params) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.SGD(
            params,
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            **_fused(params),
        )


@dataclass(frozen=True)
class Adam:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False  # True -> AdamW

    def __post_init__(self):
        check_fields(
            self,
            lr=(check_positive, "Adam lr"),
            betas=(_betas, "Adam betas"),
            eps=(check_positive, "Adam eps"),
            weight_decay=(check_nonnegative, "Adam weight_decay"),
            decoupled=(check_bool, "Adam decoupled"),
        )

    def build(self, params):
        params = list(params)
        cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, **_fused(params))


@dataclass(frozen=True)
class Adafactor:
    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: tuple[float | None, float] = (None, 1e-3)
    weight_decay: float = 0.0

    def __post_init__(self):
        check_fields(
            self,
            lr=(check_positive, "Adafactor lr"),
            beta2_decay=(check_number, "Adafactor beta2_decay"),
            eps=(_eps_pair, "Adafactor eps"),
            weight_decay=(check_nonnegative, "Adafactor weight_decay"),
        )
        if self.beta2_decay > 0:
            raise UserError(f"Adafactor beta2_decay must be <= 0 (got {self.beta2_decay})")

    def build(self, params):
        return torch.optim.Adafactor(
            params, lr=self.lr, beta2_decay=self.beta2_decay, eps=self.eps, weight_decay=self.weight_decay
        )


def _fused(params) -> dict:
    """``fused=True`` on CUDA: one kernel for the whole update and no host read of Adam's step count
    (the foreach and single-tensor forms call ``.item()`` on it, a host sync every step). The
    arithmetic is the optimizer's, on already-privatized gradients: no privacy role."""
    if params and all(
        isinstance(p, torch.Tensor) and p.device.type == "cuda" and p.is_floating_point() for p in params
    ):
        return {"fused": True}
    return {}


Optimizer = SGD | Adam | Adafactor


def own_optimizer(optimizer: torch.optim.Optimizer, params: list, master: list) -> torch.optim.Optimizer:
    """The caller's optimizer (make_private), checked: it must step exactly the trainable
    parameters the engine privatizes, and they must be float32 or wider (with narrower weights the
    engine steps float32 masters of its own, which a caller's optimizer does not hold).

    Raises:
        UserError: the optimizer holds other tensors, misses a trainable parameter, or the
            parameters are float16/bfloat16."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if master is not params:
        raise UserError(
            "make_private: the model's trainable parameters are float16/bfloat16; keep float32 "
            "weights and set Performance(precision='bfloat16') for mixed precision, or use train(), "
            "which steps float32 master weights"
        )
    held = [p for g in optimizer.param_groups for p in g["params"]]
    mine = {id(p) for p in params}
    if {id(p) for p in held} != mine or len(held) != len(mine):
        raise UserError(
            f"make_private: the optimizer must hold exactly the model's {len(mine)} trainable "
            f"parameters (it holds {len(held)} tensors, {len({id(p) for p in held} & mine)} of them "
            "trainable parameters of the model)"
        )
    return optimizer

"""Private selection (Papernot & Steinke 2022): run a random number K of trials, release the best.

Picking the best of a *fixed* number of private runs leaks more than one run (a run that happens to
do well on someone's data is chosen because of it). If K is itself random — truncated negative
binomial (TNB) or Poisson — the release of the best trial costs only a little more than one trial,
in Rényi DP:

* **TNB(eta, gamma)**, eta >= 0, 0 < gamma < 1 (their Theorem 2): if every trial is (lambda, rho(lambda))-RDP
  for all lambda > 1, releasing the best of K trials is (lambda, rho'(lambda))-RDP with

      rho'(lambda) = rho(lambda) + (1 + eta) * min_{lambda_hat >= 1} [ (1 - 1/lambda_hat) rho(lambda_hat)
                                                                   + log(1/gamma) / lambda_hat ]
                     + log(E[K]) / (lambda - 1).

  eta = 1 is the geometric distribution; eta = 0 the logarithmic one (the smallest overhead).
* **Poisson(mu)** (their Theorem 6): if every trial is (lambda, rho(lambda))-RDP and
  (eps_hat, delta_hat)-DP with eps_hat = log(1 + 1/(lambda - 1)), then
  rho'(lambda) = rho(lambda) + mu * delta_hat + log(mu) / (lambda - 1). (K = 0 releases nothing.)

The minimum over lambda_hat is taken on the order grid (any lambda_hat gives a valid bound, so the
grid minimum is conservative). Everything here is a function of numbers: the trials' RDP curve
comes from :func:`userdp.accounting.rdp.step_rdp` and the ledger's step event.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import optimize, special

from userdp.errors import UserError


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials K.

    Args:
        kind: "tnb" (truncated negative binomial) or "poisson".
        eta: TNB shape, >= 0 (1: geometric, 0: logarithmic).
        gamma: TNB parameter in (0, 1).
        mu: Poisson mean > 0.
    """

    kind: str
    eta: float = 1.0
    gamma: float = 0.1
    mu: float = 10.0

    def __post_init__(self):
        if self.kind == "tnb":
            if not (self.eta >= 0 and 0 < self.gamma < 1):
                raise UserError(
                    f"truncated negative binomial: need eta >= 0 and 0 < gamma < 1 (got {self.eta}, {self.gamma})"
                )
        elif self.kind == "poisson":
            if not self.mu > 0:
                raise UserError(f"Poisson trial count: need mu > 0 (got {self.mu})")
        else:
            raise UserError(f"trial count distribution must be tnb or poisson, got {self.kind!r}")

    @classmethod
    def with_mean(cls, kind: str, mean: float, eta: float = 1.0) -> TrialCount:
        """The distribution of the given family whose mean number of trials is ``mean`` (> 1 for TNB)."""
        if kind == "poisson":
            return cls("poisson", mu=float(mean))
        if not mean > 1:
            raise UserError(f"the mean number of trials must be > 1 for the truncated negative binomial, got {mean}")
        f = lambda lg: cls("tnb", eta=eta, gamma=math.exp(lg)).mean() - mean
        lg = optimize.brentq(f, math.log(1e-12), math.log(1 - 1e-12), xtol=1e-14)
        return cls("tnb", eta=eta, gamma=math.exp(lg))

    def mean(self) -> float:
        """E[K]."""
        if self.kind == "poisson":
            return self.mu
        g, e = self.gamma, self.eta
        if e == 0:
            return (1 / g - 1) / math.log(1 / g)
        return e * (1 - g) / (g * (1 - g**e))

    def pmf(self, k) -> np.ndarray:
        """P[K = k] for integer k (0 for k < 1 under TNB)."""
        k = np.asarray(k, dtype=np.float64)
        if self.kind == "poisson":
            return np.exp(k * math.log(self.mu) - self.mu - special.gammaln(k + 1))
        g, e = self.gamma, self.eta
        with np.errstate(divide="ignore"):
            if e == 0:
                out = np.exp(k * math.log1p(-g) - np.log(k) - math.log(math.log(1 / g)))
            else:
                # prod_{l<k} (l+eta)/(l+1) = Gamma(k+eta) / (Gamma(eta) Gamma(k+1))
                logc = special.gammaln(k + e) - special.gammaln(e) - special.gammaln(k + 1)
                out = np.exp(logc + k * math.log1p(-g) - math.log(g ** (-e) - 1))
        return np.where(k >= 1, out, 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K."""
        if self.kind == "poisson":
            return int(rng.poisson(self.mu))
        if self.eta == 0:
            return int(rng.logseries(1 - self.gamma))
        while True:  # a negative binomial conditioned on K >= 1 (rejection; P[K=0] = gamma^eta)
            k = int(rng.negative_binomial(self.eta, self.gamma))
            if k >= 1:
                return k

    def to_dict(self) -> dict:
        return {**asdict(self), "mean": self.mean()}


def selection_rdp(orders: np.ndarray, rho: np.ndarray, count: TrialCount) -> np.ndarray:
    """RDP of releasing the best of K trials, each (orders[i], rho[i])-RDP (see the module docstring).

    Orders <= 1 are ignored (inf). Returns an array like ``rho``."""
    orders = np.asarray(orders, dtype=np.float64)
    rho = np.asarray(rho, dtype=np.float64)
    out = np.full_like(rho, np.inf)
    ok = orders > 1
    if count.kind == "tnb":
        hat = orders >= 1
        inner = np.min((1 - 1 / orders[hat]) * rho[hat] + math.log(1 / count.gamma) / orders[hat])
        out[ok] = rho[ok] + (1 + count.eta) * inner + math.log(count.mean()) / (orders[ok] - 1)
        return out
    for i in np.flatnonzero(ok):
        lam = orders[i]
        eps_hat = math.log1p(1 / (lam - 1))
        delta_hat = float(rdp_lib.compute_delta(orders, rho, eps_hat)[0])
        out[i] = rho[i] + count.mu * delta_hat + math.log(count.mu) / (lam - 1)
    return out


def epsilon_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """(eps, delta) from an RDP curve (dp_accounting's conversion)."""
    eps, _ = rdp_lib.compute_epsilon(np.asarray(orders), np.asarray(rdp), delta)
    return float(eps)

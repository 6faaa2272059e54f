"""The noise mechanism: a stateful transform of the step's clipped sum (jax_privacy's
``noise_addition`` transforms have this shape), and its registry.

A mechanism holds no state of its own: the run holds it, the distribution decides where, the
checkpoint keeps it for a seeded run only, and nothing released carries it. The contract (what
:class:`IIDGaussian` implements and every mechanism inherits):

* ``init(numel, dtype, device) -> state``: the state over the ``numel`` coordinates this rank noises
  (the whole sum where the model is replicated, the rank's own parts where the distribution splits it), in the draw's
  dtype on the sums' device; None for a mechanism with no state across steps.
* ``update(sums, state, std) -> (sums, state)``: this step's noise, ``std`` times the unit-scale
  noise, added to the clipped ``sums`` (in place, float32 or wider), and the next state. The default
  draws the keyed source's standard normals over the sums and maps each piece through ``filter``.
* ``filter(z, lo, state) -> w`` and ``advance(state) -> state``: the mechanism coordinate by
  coordinate: the unit-scale noise of coordinates ``[lo, lo + len(z))`` from the same coordinates'
  standard normals and the state (the identity for i.i.d. noise; may change ``z`` in place), and the
  state once every piece of a step is filtered. A distribution that scatters the draw (one whose
  ranks each hold part of the model) composes the step from these on each rank's own coordinates,
  so a mechanism written this way runs under every distribution; one that overrides ``update``
  instead runs where the model is whole.
* ``state_dict(state) -> dict`` / ``load_state(saved, state) -> state``: the saved form, whose
  ``"past"`` entry (if any) lists flat vectors over the coordinates, newest first (a distribution that
  splits the model saves them whole and restores each rank's part), beside the source's ``"source"`` state.
* ``begin_step(numel, dtypes)``: a step's sums are about to be computed (a host source may draw
  meanwhile); ``scalar(std)``: one draw for a scalar query; ``to_record()``: what the privacy
  record says of a mechanism that is not i.i.d. Gaussian (None for it).

A mechanism whose accounting is not the i.i.d. Gaussian of :class:`userdp.accounting.Mechanism`
declares it (:class:`~userdp.engine.noise.bandmf.BandMF`: ``banded``, its sampler and its events).
A new mechanism is one file plus a test, registered in :data:`NOISE_MECHANISMS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from userdp.engine.noise.flat import add_piece, flat_views
from userdp.engine.noise.gaussian import GaussianNoise, draw_dtype
from userdp.errors import UserError
from userdp.registry import Registry

#: a mechanism's state across steps (its own type: None for i.i.d. noise, BandMF's ``Stream``, a
#: plugin's dict): held by the run, passed in and returned, never released
NoiseState = Any


class IIDGaussian:
    """Independent N(0, std² I) noise every step: the mechanism DP-SGD and DP-FedAvg account, and
    the identity case of every filter (no state across steps).

    Args:
        source: the keyed generator of standard normals (None on ranks that draw none; only the
            main rank draws, once per step for the whole sum).
    """

    name = "iid_gaussian"
    #: whether :meth:`filter` is not the identity (else the draw is added as it is made)
    filtered = False

    def __init__(self, source: Any):
        self.source = source

    # ------------------------------------------------------------------ the transform
    def init(self, numel: int, dtype: torch.dtype, device) -> NoiseState:
        """The state over ``numel`` coordinates of ``dtype`` on ``device``: none for i.i.d. noise."""
        return None

    def update(
        self, sums: Sequence[torch.Tensor], state: NoiseState, std: float
    ) -> tuple[Sequence[torch.Tensor], NoiseState]:
        """Add this step's noise (``std`` on the scale of the sum) to ``sums`` in place and return
        them with the next state. The sums are float32 or float64; the noise never passes through a
        narrower type. Nothing is drawn without a source or where ``std`` is 0 (a non-private run)."""
        if self.source is None or not std > 0:
            return sums, state
        if not self.filtered:  # the draw added as it is made, a piece at a time in the pool's threads
            self.source.add_(sums, std)
        elif isinstance(self.source, GaussianNoise):  # the filter runs inside the draw, a piece at a time
            self.source.add_(sums, std, transform=lambda z, lo: self.filter(z, lo, state))
        else:  # a device source (ChaCha on CUDA): one draw, filtered, then added
            flats, offsets = flat_views(sums)
            like = torch.empty(offsets[-1], dtype=draw_dtype(t.dtype for t in sums), device=flats[0].device)
            z = self.source.like([like], 1.0)[0]
            add_piece(flats, offsets, self.filter(z, 0, state).mul_(float(std)), 0)
        return sums, self.advance(state)

    def filter(self, z: torch.Tensor, lo: int, state: NoiseState) -> torch.Tensor:
        """The unit-scale noise of coordinates ``[lo, lo + len(z))``: the standard normals themselves."""
        return z

    def advance(self, state: NoiseState) -> NoiseState:
        """The state after a step whose every piece was filtered: unchanged."""
        return state

    def draws(self, numel: int, dtypes: Sequence[torch.dtype], device):
        """This step's standard normals over ``numel`` coordinates, in order, as ``(offset, piece)``
        (the main rank's source; what a distribution that scatters the draw reads)."""
        return self.source.pieces(numel, dtypes, device)

    # ------------------------------------------------------------------ around the step
    def begin_step(self, numel: int, dtypes: Sequence[torch.dtype]) -> None:
        """The step's sums (``numel`` numbers of ``dtypes``) are about to be computed: a host source
        begins drawing their normals in its threads meanwhile (:meth:`GaussianNoise.prefetch`; the same
        numbers as drawing then, added once or dropped)."""
        prefetch = getattr(self.source, "prefetch", None)
        if prefetch is not None:
            prefetch(numel, dtypes)

    def scalar(self, std: float) -> float:
        """One N(0, std²) draw for a scalar query (adaptive clipping's count); 0 without a source."""
        return self.source.scalar(std) if (self.source is not None and std) else 0.0

    # ------------------------------------------------------------------ state
    def state_dict(self, state: NoiseState) -> dict:
        """The saved form of the source's state and ``state`` (seeded runs only: both are secret)."""
        return {"source": self.source.state_dict() if self.source is not None else None}

    def load_state(self, saved: dict, state: NoiseState) -> NoiseState:
        """The state :meth:`state_dict` saved, restored into ``state`` (made by :meth:`init`)."""
        if self.source is not None and saved.get("source") is not None:
            self.source.load_state_dict(saved["source"])
        return state

    def to_record(self) -> dict | None:
        """What the privacy record says of the mechanism beyond its name (None: i.i.d. Gaussian)."""
        return None


#: name -> mechanism class; ``TrainConfig.noise`` picks one
NOISE_MECHANISMS: Registry = Registry("noise", {"iid_gaussian": IIDGaussian})


def noise_buffers(name: str, bands: int) -> int:
    """Model-sized vectors the mechanism called ``name`` keeps across steps with ``bands`` (its class's
    ``buffers(bands)``; 0 for i.i.d. noise and for a plugin that does not say)."""
    return int(getattr(NOISE_MECHANISMS.lookup(name), "buffers", lambda bands: 0)(bands))


def make_noise(name: str, source: Any) -> IIDGaussian:
    """The noise mechanism called ``name`` over ``source``.

    Raises:
        UserError: an unknown name (the message lists the registered ones).
    """
    return NOISE_MECHANISMS.lookup(name)(source)


#: what the run calls on every mechanism (a subclass of :class:`IIDGaussian` inherits them all)
CONTRACT = ("init", "update", "begin_step", "scalar", "state_dict", "load_state")


def check_contract(noise: Any) -> None:
    """Refuse, before any step, a mechanism written to the contract before 0.9 (``add_noise`` /
    ``pieces``, state in the object: its methods would never be called, and the run would add another
    noise than it says), or one that lacks a method the run calls (it would fail inside a step).

    Raises:
        UserError: naming the mechanism and the methods it should define instead."""
    old = [m for m in ("add_noise", "pieces") if callable(getattr(noise, m, None))]
    if old:
        raise UserError(
            f"the noise mechanism {type(noise).__name__} defines {' and '.join(old)}(), the contract before "
            "userdp 0.9: define update(sums, state, std) -> (sums, state), or filter(z, lo, state) and "
            "advance(state) (userdp.engine.noise.mechanism)"
        )
    missing = [m for m in CONTRACT if not callable(getattr(noise, m, None))]
    if missing:
        raise UserError(
            f"the noise mechanism {type(noise).__name__} has no {', '.join(missing)}(): subclass "
            "userdp.engine.noise.mechanism.IIDGaussian, which defines the contract"
        )

"""Deliberately broken builds, to prove that the audit can catch one (issue: an audit that cannot
catch a broken mechanism proves nothing).

:func:`broken_build` patches the engine *inside a ``with`` block only*, so that a run claims the
epsilon of the intact mechanism while doing something else:

* ``noise_off`` — no noise is added to the clipped sum;
* ``clipping_off`` — per-unit updates are not clipped (the sensitivity the accountant assumes is false);
* ``user_counted_g_times`` — every sampled unit's clipped update is added ``times`` times (a user
  whose G records were each treated as a unit: sensitivity ``times * C``).

Every run made under a fault carries ``"broken_build": <fault>`` in its engine record (and so in
``privacy.json``). Used by the tests and ``benchmarks/bench_audit.py``; never by the CLI.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from userdp.engine import clipping, loop, noise
from userdp.errors import UserError

FAULTS = ("noise_off", "clipping_off", "user_counted_g_times")


@contextmanager
def broken_build(fault: str, times: int = 8):
    """Run the ``with`` block on a broken engine (see the module docstring).

    Args:
        fault: one of :data:`FAULTS`.
        times: how often ``user_counted_g_times`` counts each unit.

    Raises:
        UserError: an unknown fault.
    """
    if fault not in FAULTS:
        raise UserError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    record = loop.EngineRun.record

    def marked_record(self):
        return record(self).replace(broken_build=fault)

    patch(loop.EngineRun, "record", marked_record)
    if fault == "noise_off":
        patch(noise.IIDGaussian, "add_noise", lambda self, tensors, std: None)
    elif fault == "clipping_off":
        flat = clipping.FlatClip.factors_from_norms

        def unclipped(self, tn, state):
            f, norms = flat(self, tn, state)
            return torch.ones_like(f), norms

        patch(clipping.FlatClip, "factors_from_norms", unclipped)
    else:
        clipped_sum = loop.EngineRun.clipped_sum

        def counted(self, ids, n_chunks=None, lazy=False):  # every unit's clipped update added `times` times
            sums, stats = clipped_sum(self, ids, n_chunks, lazy)
            return [s.mul_(float(times)) for s in sums], stats

        patch(loop.EngineRun, "clipped_sum", counted)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)

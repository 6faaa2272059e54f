"""The noise part of a step: what is added to the clipped sum before it is released.

Two layers (each module's docstring says what it holds):

- a **source**: a keyed generator of i.i.d. standard normals, keyed by ≥ 128 bits of OS entropy
  (or by the user's seed, reproducibly): :class:`~.gaussian.GaussianNoise` on the host (AES-256-CTR
  words, :mod:`~.aes`, through numpy's ziggurat compiled, :mod:`~.ziggurat`),
  :class:`~.chacha.ChaChaNoise` on a device (ChaCha20 in torch ops, or the Triton
  kernel of :mod:`~.chacha_triton`); :func:`~.gaussian.source_for` picks one for the device;
- a **mechanism** (:mod:`~.mechanism`), registered in :data:`~.mechanism.NOISE_MECHANISMS`
  (``TrainConfig.noise`` names it): a stateful transform of the sum over the source, whose state
  the run holds. Its contract: ``init(numel, dtype, device) -> state``; per step
  ``update(sums, state, std) -> (sums, state)`` (on the main rank of a replicated model), or, where a
  distribution scatters the draw, ``filter(z, lo, state) -> w`` on each rank's coordinates then
  ``advance(state) -> state``; ``state_dict(state)`` / ``load_state(saved, state)`` (checkpointed for
  seeded runs only, never released). A mechanism whose accounting is not i.i.d. Gaussian declares
  its own (:class:`~.bandmf.BandMF`). A new mechanism is one file plus a test (docs/engine.md).

:mod:`~.flat` lays a draw over a list of tensors as one flat vector.
"""

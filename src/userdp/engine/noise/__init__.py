"""The noise part of a step: what is added to the clipped sum before it is released.

Two layers (each module's docstring says what it holds):

- a **source**: a keyed generator of i.i.d. standard normals, keyed by ≥ 128 bits of OS entropy
  (or by the user's seed, reproducibly): :class:`~.gaussian.GaussianNoise` on the host (numpy's
  PCG64DXSM), :class:`~.chacha.ChaChaNoise` on a device (ChaCha20 in torch ops, or the Triton
  kernel of :mod:`~.chacha_triton`); :func:`~.gaussian.source_for` picks one for the device;
- a **mechanism**, registered in :data:`~.gaussian.NOISE_MECHANISMS` (``TrainConfig.noise``
  names it): the noise a step adds, from the source and its own state across steps.
  Its contract: ``init(params)`` once; per step ``add_noise(sums, std)`` (in place, on the
  main rank) or ``pieces(numel, dtypes, std, device)`` (the same draw read in order, for a
  distribution that scatters it); ``state_dict`` / ``load_state_dict`` (checkpointed for seeded
  runs only, never released); ``correlated`` where its state spans steps. A mechanism whose
  accounting is not i.i.d. Gaussian declares its own DpEvent (:class:`~.bandmf.BandMF`).
  A new mechanism is one file here plus a test (docs/engine.md).

:mod:`~.flat` lays a draw over a list of tensors as one flat vector.
"""

"""One training run: its step and the loop that drives it.

- :mod:`~.step`: :class:`~.step.EngineRun`, the run's state and its step, a composition of the
  plan's parts (the sampler, the per-unit strategy, the clipping, the noise mechanism, the
  distribution, the ledger, the optimizer);
- :mod:`~.loop`: :func:`~.loop.train`, the loop over steps, its stops and its checkpoints;
- :mod:`~.options`: :class:`~.options.RunOptions`, where and how a run is kept (none of it
  changes what is released);
- :mod:`~.state`: the run's checkpoint (what is saved, restored and re-keyed);
- :mod:`~.record`: the run's privacy record (what the statement says of it).
"""

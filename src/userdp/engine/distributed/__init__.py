"""The distribution part of a run: how a step's work and its release are shared out across the
processes of a ``torch.distributed`` job (docs/scaling.md).

- :mod:`~.distribution`: the contract (:class:`~.distribution.Replicated`) and its variants,
  registered in :data:`~.distribution.DISTRIBUTIONS` (``Performance.sharding`` names one): how
  the model is held, how each rank's clipped sums accumulate, how many chunks each rank runs,
  where the one noise draw is made and how the noised sums reach every rank, how the
  checkpoint's state is laid out, and which coverage-check part the ghost strategy uses;
- :mod:`~.sharding`: FSDP2's stages (shard, reduce-scatter, scatter from the main rank, the
  checkpoint's shards, the gathered-tensor coverage check);
- :mod:`~.processes`: the combiners (one process, or ``torch.distributed`` all-reduces and
  broadcasts) and the job's start-up.

Only this package branches on how the model is held; the step asks the distribution part.
A new distribution is one class registered in :data:`~.distribution.DISTRIBUTIONS` plus a test.
"""

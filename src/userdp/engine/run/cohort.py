"""The cohort's part of a step (:class:`Chunks`): the generators a step's cohort and its units'
record draws come from, and the loading of the sampled units a chunk at a time onto the device.

Every generator is keyed by the run's data key and its use alone (:data:`userdp.engine.run.state.COHORT`,
``UNIT_DRAWS``, ``BOUNDING``), so one user's presence never moves another user's membership or
records: a step's cohort stream depends on the step only, a unit's record draw on the step and the
unit only, and the one-time contribution bounding (ELS's D') has a stream of its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from userdp.engine.run.state import BOUNDING, COHORT, POOL, UNIT_DRAWS
from userdp.engine.sampling import bucket_size
from userdp.engine.user_data import compact_groups
from userdp.errors import UserError


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a blocking copy: pinned and non-blocking on CUDA (a
    pageable copy waits for the device), as is elsewhere."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=device.type != "cpu")


def to_host(stats: torch.Tensor) -> torch.Tensor:
    """The step's statistics on the host. A model on the meta device (shapes without values) has
    none to give: one line, not torch's "cannot copy out of meta tensor" (the tests that count a
    step's syncs on meta answer this read themselves).

    Raises:
        UserError: the parameters are on the meta device."""
    try:
        return stats.cpu()
    except NotImplementedError:
        if stats.is_meta:
            raise UserError(
                "model: its parameters are on the meta device (shapes without values): load its weights first "
                "(e.g. from_pretrained without device_map='meta', or to_empty() and load_state_dict)"
            ) from None
        raise


def padded_size(n: int, chunk_size: int, device: torch.device) -> int:
    """The units a chunk of ``n`` is computed as. On a CPU, ``n``: a padding unit is computed in full
    (a cohort of 20 padded to a bucket of 32 cost 1.6× its step; ``benchmarks/bench_hf.py``). On
    other devices a bucket (:func:`~userdp.engine.sampling.bucket_size`: a power of two up to the
    chunk size), so that a run's chunks take a few shapes whatever its Poisson cohorts. Padding
    units carry mask 0 and contribute exactly nothing. How long a chunk takes depends on its real
    units on a CPU, on its bucket elsewhere, as a step's depends on its count of chunks: the step's
    time is not released (only the private diagnostics hold it)."""
    return int(n) if device.type == "cpu" else bucket_size(n, chunk_size)


def bounding_rng(data_key: int) -> np.random.Generator:
    """The generator of the run's one-time contribution bounding (ELS's D'): keyed by the data
    key alone and used for nothing else, so the cohort draws are the same whether or not a user
    with more than G records is present (the neighbour test at a sampling rate below 1)."""
    return np.random.default_rng(np.random.SeedSequence(data_key, spawn_key=(BOUNDING,), pool_size=POOL))


class Chunks:
    """A run's units, drawn and loaded: ``table`` (the algorithm's unit table), the data they
    index, ``like`` (a parameter: the device the chunks go to and the dtype of their masks), the
    chunk size, and the data key (:attr:`data_key`; a resumed seeded run is keyed anew)."""

    def __init__(self, algo, data, table, like: torch.Tensor, chunk_size: int, data_key: int):
        self.algo, self.data, self.table = algo, data, table
        self.device, self.dtype, self.chunk_size, self.data_key = like.device, like.dtype, chunk_size, data_key
        # a user's masked mean gradient does not see its padding slots: trim them (compact_groups)
        self.compact = algo.unit == "user" and algo.update == "gradient" and algo.records_per_unit > 1
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="userdp-load")
        self._padding = None  # a zero-weight chunk (padding_chunk)

    def close(self) -> None:
        """Stop the loading thread (the run is over)."""
        self._loader.shutdown(wait=True)

    def cohort_rng(self, step: int) -> np.random.Generator:
        """The generator of step ``step``'s cohort: keyed by the data key and the step alone, so unit
        i's draw at a step is the i-th of that step's stream whatever the number of units (a user
        appended last moves no other unit's membership at any step: a sequential stream shifted every
        later step's draws by one), and a resume continues the same cohorts with no state saved."""
        return np.random.default_rng(
            np.random.SeedSequence(self.data_key, spawn_key=(COHORT, int(step)), pool_size=POOL)
        )

    def unit_rng(self, step: int, unit: int) -> np.random.Generator:
        """The generator of unit ``unit``'s record draw at ``step``: keyed by the run's data key,
        the step and the unit alone, so a unit draws the same records whichever rank loads it
        and however the cohort is chunked (W processes give one process's model; a resume with
        another world size continues the same run)."""
        return np.random.default_rng(
            np.random.SeedSequence(self.data_key, spawn_key=(UNIT_DRAWS, step, int(unit)), pool_size=POOL)
        )

    def split(self, ids: np.ndarray) -> list[np.ndarray]:
        """A rank's sampled units as chunks of at most the chunk size; where groups are compacted,
        users of like record counts share a chunk, so little padding is left to compute."""
        if self.compact:
            sizes = np.minimum(self.data.sizes()[self.table.users[ids]], self.algo.group_size)
            ids = ids[np.argsort(sizes, kind="stable")]
        return [ids[s : s + self.chunk_size] for s in range(0, len(ids), self.chunk_size)]

    def load(self, cid: np.ndarray, step: int):
        """One chunk's batch and mask, padded as the device wants it (:func:`padded_size`), on the device."""
        if self.algo.random_load:  # one draw per unit, from the unit's own generator
            parts = [
                self.algo.load(self.data, self.table, cid[i : i + 1], self.unit_rng(step, u)) for i, u in enumerate(cid)
            ]
            batch = self.data.concat([b for b, _ in parts])
            mask = torch.cat([m for _, m in parts])
        else:
            batch, mask = self.algo.load(self.data, self.table, cid, None)
        if self.compact:
            batch, mask = compact_groups(batch, mask)
        batch, mask = _pad(batch, mask, padded_size(len(cid), self.chunk_size, self.device))
        batch = {n: to_device(v, self.device) for n, v in batch.items()}
        return batch, to_device(mask.to(self.dtype), self.device)

    def loaded(self, chunks: list, step: int, extra: int = 0):
        """The chunks' batches in order, the next one loaded by a worker thread while this one
        computes (each unit's records come from its own generator, so the order is moot); then
        ``extra`` zero-weight padding chunks (:meth:`padding_chunk`)."""
        last = None
        if chunks:
            pending = self._loader.submit(self.load, chunks[0], step)
            for i in range(len(chunks)):
                last = pending.result()
                if i + 1 < len(chunks):
                    pending = self._loader.submit(self.load, chunks[i + 1], step)
                yield last
        for _ in range(extra):
            yield self.padding_chunk(last)

    def padding_chunk(self, template):
        """A chunk of one unit whose mask and weight are zero (its update is exactly zero, it counts
        for nothing): a rank with fewer units than another runs these where the distribution asks
        every rank to run as many chunks. Its records are a real unit's (a finite forward), masked out."""
        if self._padding is None:
            batch, mask = template if template is not None else self.load(np.zeros(1, dtype=np.int64), 0)
            self._padding = ({n: v[:1].clone() for n, v in batch.items()}, torch.zeros_like(mask[:1]))
        return self._padding


def _pad(batch: dict, mask: torch.Tensor, b: int):
    """The chunk's batch and mask with rows repeated up to ``b`` (its bucket size), the extra rows' mask 0."""
    k = mask.shape[0]
    if b == k:
        return batch, mask
    idx = torch.cat([torch.arange(k), torch.zeros(b - k, dtype=torch.long)])
    batch = {n: v[idx] for n, v in batch.items()}
    mask = torch.cat([mask, torch.zeros(b - k, *mask.shape[1:], dtype=mask.dtype)])
    return batch, mask

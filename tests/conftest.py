import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one compute thread per xdist worker: `-n auto` already runs one worker per core, and torch's
    # default (a thread per core in every worker) oversubscribes the cores; subprocesses inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
SHARED_DATA = Path(os.environ.get("USERDP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """The real user-partitioned data beside the repository; skip where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs the shared data folder {SHARED_DATA} (absent here)")
    return SHARED_DATA


@pytest.fixture
def isolated_registries():
    """The registries and the loaded plugins as they were before the test (a test that loads a
    plugin, directly or through `userdp --plugin`, must not leave its names to the tests after)."""
    from userdp import plugins
    from userdp.accounting import accountants
    from userdp.engine import algorithms, noise, per_unit, sampling

    registries = (algorithms.ALGORITHMS, accountants.ACCOUNTANTS, per_unit.PER_UNIT_STRATEGIES,
                  noise.NOISE_MECHANISMS, sampling.SAMPLERS)
    saved = [dict(r._items) for r in registries], dict(plugins._LOADED)
    yield
    for r, items in zip(registries, saved[0]):
        r._items = items
    plugins._LOADED.clear()
    plugins._LOADED.update(saved[1])


#: the suite's longest tests (minutes each on 2 cores): started first, so that under `-n auto`
#: they run beside the short ones instead of after them (a long test started last sets the wall time)
LONGEST = ("test_bench_tradeoffs.py", "test_audit_power.py", "test_gpu_check.py", "test_distributed.py",
           "test_tuning.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first, then the other `slow` tests, then the rest; the order within each
    group is kept (every xdist worker computes the same order, as it must)."""
    def rank(item):
        name = item.path.name
        if name in LONGEST:
            return 0, LONGEST.index(name)
        return (1, 0) if item.get_closest_marker("slow") else (2, 0)

    items[:] = sorted(items, key=rank)

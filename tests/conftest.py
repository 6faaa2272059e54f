import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one compute thread per xdist worker: `-n auto` already runs one worker per core, and torch's
    # default (a thread per core in every worker) oversubscribes the cores; subprocesses inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


HEAVY_TIER = (
    "the heavy tier (runs of 6 s or more: several processes, a harness, statistical power, a whole "
    "pipeline; each names the test that keeps its property in this run): python -m pytest -q -n auto --heavy"
)


def pytest_addoption(parser):
    parser.addoption(
        "--heavy",
        action="store_true",
        help="also run the heavy tier (tests marked heavy: 6 s or more each on 2 cores; CI's 10 minutes leave them out)",
    )


def pytest_collection_modifyitems(config, items):
    """The heavy tier is skipped, with its reason and the command that runs it, unless --heavy."""
    if config.getoption("--heavy"):
        return
    skip = pytest.mark.skip(reason=HEAVY_TIER)
    for item in items:
        if item.get_closest_marker("heavy"):
            item.add_marker(skip)


def pytest_configure(config):
    """One folder for the whole session, every xdist worker (they inherit the environment): what the
    tests build once and share (tests/_lm_corpus.py: the tiny pretrained model)."""
    if not os.environ.get("USERDP_TEST_SESSION"):
        os.environ["USERDP_TEST_SESSION"] = tempfile.mkdtemp(prefix="userdp-tests-")
        config._userdp_session_dir = os.environ["USERDP_TEST_SESSION"]


def pytest_unconfigure(config):
    folder = getattr(config, "_userdp_session_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("USERDP_TEST_SESSION", None)


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
    from userdp.engine import algorithms, per_unit, sampling
    from userdp.engine.distributed import distribution
    from userdp.engine.noise import mechanism as noise

    registries = (
        algorithms.ALGORITHMS,
        accountants.ACCOUNTANTS,
        per_unit.PER_UNIT_STRATEGIES,
        noise.NOISE_MECHANISMS,
        sampling.SAMPLERS,
        distribution.DISTRIBUTIONS,
    )
    saved = [dict(r._items) for r in registries], dict(plugins._LOADED)
    yield
    for r, items in zip(registries, saved[0], strict=True):
        r._items = items
    plugins._LOADED.clear()
    plugins._LOADED.update(saved[1])

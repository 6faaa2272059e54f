import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("USERDP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """The real user-partitioned data beside the repository; skip where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs the shared data folder {SHARED_DATA} (absent here)")
    return SHARED_DATA

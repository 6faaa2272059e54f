"""Where things are, for tests at any depth under tests/: the repository and the tests folder
(the helpers ``_engine_helpers``, ``_lm_corpus``, ... live there; tests/conftest.py puts it on
sys.path)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

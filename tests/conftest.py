"""Shared pytest configuration.

Test helpers live in ``tests/helpers.py`` as plain functions (no fixtures);
tests import them as ``from tests.helpers import write_test_volume``.  For
that, the repository root must be importable, so it is put on ``sys.path``
here: ``tests/`` has no ``__init__.py`` (``tests/io`` as a package would
shadow the standard library's ``io``).
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _private_size_cache(tmp_path, monkeypatch):
    """``--block auto`` caches its trials: each test gets its own cache, never the user's."""
    monkeypatch.setenv("BLOCKPRED_CACHE_DIR", str(tmp_path / "blockpred-cache"))

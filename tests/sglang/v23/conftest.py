"""Fixtures for the SGLang 0.5.23 tests: its own cache on hiradix's L3 backends, and
hiradix's cache on 0.5.23 (see :mod:`sglang_unified_env`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def sglang_cpu():
    """SGLang's caches run on CPU for the test (:func:`patch_sglang_for_cpu`); the caches
    built meanwhile are shut down at teardown."""
    # Imported here, not above: without SGLang 0.5.23 the import skips the test module
    # that asked (saying why), where in a conftest it would be a collection error.
    from sglang_unified_env import patch_sglang_for_cpu

    with patch_sglang_for_cpu():
        yield

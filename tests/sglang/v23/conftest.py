"""Fixtures for the SGLang 0.5.23 tests: its own cache on hiradix's L3 backends, and
hiradix's cache on 0.5.23 (see :mod:`tests.sglang.unified_env`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def sglang_cpu():
    """SGLang's caches run on CPU for the test (:func:`patch_sglang_for_cpu`); the caches
    built meanwhile are shut down at teardown."""
    # Imported here, not above: without SGLang 0.5.23 the import skips the test module
    # that asked (saying why), where in a conftest it would be a collection error.
    from tests.sglang.unified_env import patch_sglang_for_cpu

    with patch_sglang_for_cpu():
        yield

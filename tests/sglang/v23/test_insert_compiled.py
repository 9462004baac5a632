"""The compiled ``insert`` (``hiradix.sglang._insert``) does what the Python method does, for
every call, on SGLang 0.5.23 (:mod:`insert_parity` drives the randomized run)."""

from __future__ import annotations

import insert_parity
import pytest
from sglang_unified_env import build_hiradix

pytestmark = [
    pytest.mark.usefixtures("sglang_cpu"),
    pytest.mark.skipif(
        insert_parity.COMPILED is None, reason="hiradix.sglang._insert is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_insert_is_the_python_insert(page_size: int, seed: int) -> None:
    a, b = build_hiradix(page_size, size=2048), build_hiradix(page_size, size=2048)
    try:
        seen = insert_parity.run(a, b, seed=seed, steps=300)
    finally:
        for env in (a, b):
            env.cache.core.close()
    assert seen["prefix hits"] > 10 and seen["backups asked"] > 10, seen


def test_eagle_keys_take_the_python_method() -> None:
    assert "insert" in vars(build_hiradix(1).cache)
    assert "insert" not in vars(build_hiradix(1, eagle=True).cache)

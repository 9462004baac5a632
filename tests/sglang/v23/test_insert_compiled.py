"""The compiled ``insert`` (``hiradix.sglang._insert``) does what the Python method does, for
every call, on SGLang 0.5.23 (:mod:`tests.sglang.insert_parity` drives the randomized run)."""

from __future__ import annotations

import pytest

from tests.sglang import insert_parity
from tests.sglang.unified_env import build_hiradix

pytestmark = [
    pytest.mark.usefixtures("sglang_cpu"),
    pytest.mark.skipif(
        insert_parity.COMPILED is None, reason="hiradix.sglang._insert is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


def test_eagle_keys_take_the_python_method() -> None:
    assert insert_parity.serves_compiled(build_hiradix(1).cache, "insert")
    assert not insert_parity.serves_compiled(build_hiradix(1, eagle=True).cache, "insert")

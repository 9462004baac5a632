"""The compiled ``match_prefix`` (``hiradix.sglang._match``) gives what the Python method
gives, for every key, on SGLang 0.5.23, whose results carry the device prefix's length
(:mod:`tests.sglang.match_parity` drives the randomized run)."""

from __future__ import annotations

import pytest

from tests.sglang import match_parity
from tests.sglang.unified_env import build_hiradix

pytestmark = [
    pytest.mark.usefixtures("sglang_cpu"),
    pytest.mark.skipif(
        match_parity.COMPILED is None, reason="hiradix.sglang._match is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


def test_eagle_keys_take_the_python_method() -> None:
    assert match_parity.serves_compiled(build_hiradix(1).cache, "match_prefix")
    assert not match_parity.serves_compiled(build_hiradix(1, eagle=True).cache, "match_prefix")

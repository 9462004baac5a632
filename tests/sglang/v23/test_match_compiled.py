"""The compiled ``match_prefix`` (``hiradix.sglang._match``) gives what the Python method
gives, for every key, on SGLang 0.5.23, whose results carry the device prefix's length
(:mod:`match_parity` drives the randomized run)."""

from __future__ import annotations

import match_parity
import pytest
from sglang_unified_env import build_hiradix

pytestmark = [
    pytest.mark.usefixtures("sglang_cpu"),
    pytest.mark.skipif(
        match_parity.COMPILED is None, reason="hiradix.sglang._match is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_match_is_the_python_match(page_size: int, seed: int) -> None:
    env = build_hiradix(page_size, size=2048)
    assert match_parity.run(env, seed=seed, steps=300) > 0, "no host hit: the anchor path went untested"


def test_eagle_keys_take_the_python_method() -> None:
    assert "match_prefix" in vars(build_hiradix(1).cache)
    assert "match_prefix" not in vars(build_hiradix(1, eagle=True).cache)

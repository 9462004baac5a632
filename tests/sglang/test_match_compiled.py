"""The compiled ``match_prefix`` (``hiradix.sglang._match``) gives what the Python method
gives, for every key of a randomized run (:mod:`tests.sglang.match_parity`), on the
installed SGLang (every SGLang venv). What is particular to one generation is in ``v18/``
and ``v23/``."""

from __future__ import annotations

import pytest

from tests.sglang import require_sglang

require_sglang()  # before the import below, which needs SGLang

from tests.sglang import match_parity  # noqa: E402

pytestmark = pytest.mark.skipif(
    match_parity.COMPILED is None, reason="hiradix.sglang._match is not built (HIRADIX_PUREPYTHON or no compiler)"
)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_match_is_the_python_match(make_hiradix, page_size: int, seed: int) -> None:
    env = make_hiradix(page_size, size=2048)
    assert match_parity.run(env, seed=seed, steps=300) > 0, "no host hit: the anchor path went untested"

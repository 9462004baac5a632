"""The compiled ``insert`` (``hiradix.sglang._insert``) does what the Python method does, for
every call of a randomized run (:mod:`tests.sglang.insert_parity`), on the installed SGLang
(every SGLang venv). What is particular to one generation is in ``v18/`` and ``v23/``."""

from __future__ import annotations

import pytest

from tests.sglang import require_sglang

require_sglang()  # before the import below, which needs SGLang

from tests.sglang import insert_parity  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # randomized parity of the compiled insert against the Python one, thousands of steps
    pytest.mark.skipif(
        insert_parity.COMPILED is None, reason="hiradix.sglang._insert is not built (HIRADIX_PUREPYTHON or no compiler)"
    ),
]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_insert_is_the_python_insert(make_hiradix, page_size: int, seed: int) -> None:
    a, b = make_hiradix(page_size, size=2048), make_hiradix(page_size, size=2048)
    seen = insert_parity.run(a, b, seed=seed, steps=300)
    assert seen["prefix hits"] > 10 and seen["backups asked"] > 10, seen

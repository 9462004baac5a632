"""Fixtures of the tests both SGLang generations share (``tests/sglang/test_*.py``): the
installed SGLang's version of each, so that one test body runs in every SGLang venv.
``v18/conftest.py`` and ``v23/conftest.py`` hold each generation's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.sglang import unified_hicache


@pytest.fixture
def make_hiradix() -> Iterator[Callable[..., Any]]:
    """``make(page_size=..., size=..., **options) -> Env``: hiradix.sglang's cache built on
    the installed SGLang as its scheduler builds it, with SGLang's CPU pools, allocator and
    ``ReqToTokenPool`` (:func:`tests.sglang.v18.env.build` on 0.5.18 and 0.5.20,
    :func:`tests.sglang.unified_env.build_hiradix` on 0.5.23, under its
    ``patch_sglang_for_cpu``). Every cache made is shut down and its tree core closed at
    teardown."""
    made: list[Any] = []

    def maker(build: Callable[..., Any]) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Any:
            env = build(*args, **kwargs)
            made.append(env)
            return env

        return make

    if unified_hicache():
        from tests.sglang.unified_env import build_hiradix, patch_sglang_for_cpu

        with patch_sglang_for_cpu():  # shuts the caches made down on exit
            try:
                yield maker(build_hiradix)
            finally:
                for env in made:
                    env.cache.core.close()
    else:
        from tests.sglang.v18.env import build

        try:
            yield maker(build)
        finally:
            for env in made:
                env.cache.shutdown()  # detaches and closes its storage backend
                env.cache.core.close()

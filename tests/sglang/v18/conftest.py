"""Fixtures for the SGLang adapter's tests (see :mod:`tests.sglang.v18.env`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.sglang.v18.env import Env, build, patch_sglang_for_cpu


@pytest.fixture
def make_env():
    envs: list[Env] = []

    def make(*args: Any, **kwargs: Any) -> Env:
        env = build(*args, **kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.cache.shutdown()  # detaches and closes its storage backend
        env.cache.core.close()


@pytest.fixture
def sglang_cpu(tmp_path: Path):
    """SGLang's own HiRadixCache runs on CPU for the test (:func:`patch_sglang_for_cpu`)."""
    with patch_sglang_for_cpu(tmp_path):
        yield


@pytest.fixture
def make_sglang(sglang_cpu):
    """``make_env`` for SGLang's own HiRadixCache (``impl="sglang"``); detached at teardown
    (its storage threads stopped, its backend closed)."""
    made: list[Env] = []

    def make(*args: Any, **kwargs: Any) -> Env:
        env = build(*args, impl="sglang", **kwargs)
        made.append(env)
        return env

    yield make
    for env in made:
        env.cache.shutdown()

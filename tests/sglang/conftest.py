"""Fixtures for the SGLang adapter's tests (see :mod:`sglang_env`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_env import Env, build


@pytest.fixture
def make_env():
    envs: list[Env] = []

    def make(*args: Any, **kwargs: Any) -> Env:
        env = build(*args, **kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.cache.core.close()

"""Fixtures over the tree implementations (uvloop's ``_TestBase`` x ``UVTestCase`` /
``AIOTestCase``, msgpack's pure-Python run).

``tree_cls`` runs a test once per available implementation: ``"reference"`` always, and
``"core"`` when ``hiradix.tree._core`` imports and ``HIRADIX_PUREPYTHON`` is unset or ``0``.
Every tree built through it is checked at teardown (invariants, node counters, no locks
left after ``reset()``). ``make_pair`` gives a ``(core, reference)`` pair for parity tests
and skips, saying why, when the core is unavailable or disabled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import (
    CORE_BUILT,
    CORE_ENABLED,
    CORE_SKIP_REASON,
    IMPLEMENTATIONS,
    OPS,
    assert_clean_teardown,
    make_pair,
    require_core,
)

__all__ = ["make_pair", "require_core"]


class TreeFactory:
    """Builds trees of one implementation and remembers them for the teardown check."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.module = IMPLEMENTATIONS[impl]
        self.cls = self.module.HiRadixTree
        self.created: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tree = self.cls(*args, **kwargs)
        self.created.append(tree)
        return tree

    def __repr__(self) -> str:
        return f"<{self.impl} HiRadixTree>"


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def tree_cls(request: pytest.FixtureRequest) -> Iterator[TreeFactory]:
    """A tree constructor for each available implementation (see the module docstring)."""
    factory = TreeFactory(request.param)
    yield factory
    for tree in factory.created:
        assert_clean_teardown(tree)


@pytest.fixture
def impl_module(tree_cls: TreeFactory) -> Any:
    """The module (``hiradix.tree._reference`` or ``hiradix.tree._core``) behind ``tree_cls``."""
    return tree_cls.module


def pytest_report_header(config: pytest.Config) -> str:
    if CORE_ENABLED:
        return "hiradix trees under test: reference, core"
    built = " (a built extension is present but does not import!)" if CORE_BUILT else ""
    return f"hiradix trees under test: reference only: {CORE_SKIP_REASON}{built}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if OPS:
        total = sum(OPS.values())
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(OPS.items()))
        terminalreporter.write_line(f"hiradix random operations executed: {total} ({parts})")

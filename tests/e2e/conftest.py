"""Fixtures of the real-server tests: a tiny model built once per session, SGLang servers
started as subprocesses (:mod:`tests.e2e.server`), and the reference outputs every server's outputs
must equal: the same server build with no prefix cache at all (``--disable-radix-cache``),
one server per session answering every prompt the tests ask about.

These tests run where a supported SGLang with its HTTP server is installed (CI: in each of
its three venvs); elsewhere they skip, saying why.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest


def _skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (CI runs tests/e2e in each of its SGLang venvs)"
    from hiradix._sglang_versions import UnsupportedSGLang, check_sglang_version

    try:
        check_sglang_version()
    except UnsupportedSGLang as e:
        return str(e)
    for module in ("uvicorn", "fastapi", "transformers", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: pip install -r requirements/sglang-server.txt"
    return None


_REASON = _skip_reason()


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every real-server test is slow (servers start in tens of seconds): out of the quick loop.
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
            if _REASON is not None:
                item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # Kept on the item, so that fixtures print a server's log when its test failed.
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def tiny_model(e2e_dir: Path) -> Path:
    from tests.e2e.tiny_model import build

    return build(e2e_dir / "model")


class Servers:
    """Starts servers and stops every one it started (their logs printed if the test or
    the module failed)."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.started: list[Any] = []

    def start(self, args: Sequence[str], *, name: str, env: dict[str, str] | None = None) -> Any:
        from tests.e2e.server import Server

        server = Server(self.model, args, self.workdir / name, env=env, name=name)
        self.started.append(server)
        return server.start()

    def stop_all(self, failed: bool) -> None:
        for server in self.started:
            server.stop()
            if failed:
                print(f"\n===== log of {server.name} ({server.log_path}) =====\n{server.log_tail(200)}")


def _failed(request: pytest.FixtureRequest) -> bool:
    node = request.node
    items = [node] if isinstance(node, pytest.Item) else [i for i in request.session.items if i.parent is node]
    return any(getattr(getattr(i, "rep_call", None), "failed", False) for i in items)


@pytest.fixture
def servers(tiny_model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Servers]:
    """Servers for one test."""
    s = Servers(tiny_model, tmp_path)
    yield s
    s.stop_all(_failed(request))


@pytest.fixture(scope="module")
def module_servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Servers]:
    """Servers shared by a module's tests (a server takes 20-40 s to come up here)."""
    s = Servers(tiny_model, tmp_path_factory.mktemp("servers"))
    yield s
    s.stop_all(_failed(request))


@pytest.fixture(scope="session")
def reference(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[[Sequence[Sequence[int]], int], list[list[int]]]]:
    """``reference(prompts, max_new_tokens)``: the greedy outputs of the same server build
    with no prefix cache, one request at a time (answers are remembered)."""
    s = Servers(tiny_model, tmp_path_factory.mktemp("reference"))
    server = s.start(["--disable-radix-cache", "--max-total-tokens", "4096"], name="no-cache")
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def outputs(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        out = []
        for p in prompts:
            k = (tuple(p), max_new_tokens)
            if k not in memo:
                memo[k] = server.generate(list(p), max_new_tokens)["output_ids"]
            out.append(memo[k])
        return out

    yield outputs
    s.stop_all(request.session.testsfailed > 0)

"""Fixtures of the real-server tests: a tiny model built once per session, SGLang servers
started as subprocesses (:mod:`tests.e2e.server`), and the judge of every server's outputs:
ground truth, the tiny model's greedy outputs computed by ``transformers`` in this process
(:mod:`tests.e2e.oracle`), never another server's outputs (a second server can race exactly
as the one under test does).

A mismatch explains itself: the judge re-asks the server under test and a no-cache server
of the same build (``--disable-radix-cache``, started then, once a session) each wrong
prompt alone, writes every answer with its ``cached_tokens_details`` to a JSON file under
the test's temporary directory, and says in the failure which side disagrees with ground
truth. A wrong output from hiradix's cache fails the test; a wrong output from stock
SGLang's own server (the baseline some tests compare with) makes the test xfail, naming the
SGLang version.

These tests run where a supported SGLang with its HTTP server is installed (CI: in each of
its three venvs); elsewhere they skip, saying why.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
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
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The no-cache server a mismatch is re-asked on (:class:`tests.e2e.judge.Reference`)."""
    s = Servers(tiny_model, tmp_path_factory.mktemp("reference"))
    from tests.e2e.judge import Reference

    yield Reference(s)
    s.stop_all(failed=bool(s.started))  # it ran only because something was wrong: show its log


@pytest.fixture(scope="session")
def ground_truth(tiny_model: Path) -> Any:
    """The tiny model's greedy outputs in ``transformers`` (:class:`tests.e2e.oracle.GroundTruth`)."""
    from tests.e2e.oracle import GroundTruth

    return GroundTruth(tiny_model)


_OUTCOMES: dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _OUTCOMES[report.outcome] = _OUTCOMES.get(report.outcome, 0) + 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``HIRADIX_E2E_REQUIRED=1`` (CI), a real-server run in which no test passed is a
    failure: a suite that skips everything (SGLang or its server's packages missing, a
    version refused) would otherwise guard nothing and still pass."""
    from hiradix import envvars

    if not envvars.flag("HIRADIX_E2E_REQUIRED") or exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        return
    if _OUTCOMES["passed"] == 0:
        why = _REASON or "no real-server test was collected or none passed"
        session.config.get_terminal_writer().line(
            f"HIRADIX_E2E_REQUIRED: no real-server test passed ({_OUTCOMES['skipped']} skipped): {why}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.e2e.judge import JUDGED

    total = JUDGED["exact"] + len(JUDGED["ties"]) + JUDGED["wrong"]
    if total:
        terminalreporter.write_line(
            f"ground truth (transformers, float32, greedy): {total} answers judged, {JUDGED['exact']} exact, "
            f"{len(JUDGED['ties'])} near-ties accepted, {JUDGED['wrong']} wrong"
        )
        for tie in JUDGED["ties"]:
            terminalreporter.write_line(f"  near-tie: {tie}")


@pytest.fixture
def judge(ground_truth: Any, reference: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """The judge of this test's server outputs (:class:`tests.e2e.judge.Judge`)."""
    from tests.e2e.judge import Judge

    return Judge(ground_truth, reference, tmp_path, request.node.nodeid)

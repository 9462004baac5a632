"""The judge of the real-server tests (``conftest.py``, ``oracle.py``) on answers made up
here, no server started: it passes ground truth, fails a wrong answer of hiradix's, xfails
a wrong answer of stock SGLang's (naming the version) unless it read hiradix's L3, and
writes every answer with the re-asks to a JSON file named in its message."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.judge import Judge
from tests.e2e.oracle import TIE_TOL
from tests.e2e.server import sglang_version
from tests.e2e.workload import shared_prefixes

N = 4  # new tokens a prompt


class FakeServer:
    """Answers like a server's, from ground truth, wrong on purpose for the prompts named."""

    def __init__(self, truth: Any, name: str, wrong: set[int], storage: int = 0) -> None:
        self.truth, self.name, self.wrong_first, self.storage = truth, name, wrong, storage
        self.args = ["--fake"]
        self.log_path = Path("/nonexistent.log")
        self.asked: list[tuple[int, ...]] = []

    def alive(self) -> bool:
        return True

    def answer(self, i: int, prompt: Any) -> dict[str, Any]:
        out = list(self.truth.greedy(prompt, N))
        if i in self.wrong_first:
            out[1] = (out[1] + 1) % 380 + 3  # a token the model does not choose there
        details = {"device": 0, "host": 300 - self.storage, "storage": self.storage}
        return {"output_ids": out, "meta_info": {"id": f"r{i}", "cached_tokens": 300, "cached_tokens_details": details}}

    def generate(self, prompt: Any, max_new_tokens: int) -> dict[str, Any]:
        self.asked.append(tuple(prompt))
        return {"output_ids": list(self.truth.greedy(prompt, max_new_tokens)), "meta_info": {"cached_tokens": 0}}


@pytest.fixture
def fake_judge(ground_truth: Any, tmp_path: Path) -> tuple[Judge, FakeServer]:
    reference = FakeServer(ground_truth, "no-cache", set())
    tally = {"exact": 0, "ties": [], "wrong": 0}  # made-up answers: not counted in the session's
    return Judge(ground_truth, reference, tmp_path, "test_e2e_judge", tally), reference


def _serve(server: FakeServer, prompts: Any) -> list[dict[str, Any]]:
    return [server.answer(i, p) for i, p in enumerate(prompts)]


def test_ground_truth_passes_and_a_greedy_decode_is_its_own_truth(fake_judge, ground_truth) -> None:
    judge, _ = fake_judge
    w = shared_prefixes(seed=30, n_prefixes=2, n_requests=4)
    server = FakeServer(ground_truth, "hiradix", set())
    assert judge.check(server, w.prompts, _serve(server, w.prompts), N) is None
    # transformers' token-by-token decode and its one-pass argmax agree (the judge's fast path)
    for p in w.prompts:
        verdict = ground_truth.judge(p, ground_truth.greedy(p, N))
        assert verdict.exact and verdict.ok


def test_a_wrong_token_of_hiradix_fails_with_the_diagnosis(fake_judge, ground_truth) -> None:
    judge, reference = fake_judge
    w = shared_prefixes(seed=31, n_prefixes=2, n_requests=4)
    server = FakeServer(ground_truth, "hiradix-x", {2})
    with pytest.raises(AssertionError) as e:
        judge(server, w.prompts, _serve(server, w.prompts), N)
    message = str(e.value)
    assert "hiradix's cache (hiradix-x, SGLang" in message and "on 1 of 4 requests [2]" in message, message
    assert "#2 (316-token prompt, cached 300: device 0, host 300, storage 0)" in message, message
    assert "first differs at output token 1" in message, message
    assert "re-asked: right; no-cache: right" in message, message
    # each wrong prompt was asked again alone, of the server and of the no-cache server
    assert server.asked == [w.prompts[2]] and reference.asked == [w.prompts[2]]
    path = Path(re.search(r"all answers: (\S+)", message).group(1))  # type: ignore[union-attr]
    record = json.loads(path.read_text())
    assert record["wrong"] == [2] and record["side"] == "hiradix" and record["tie_tol"] == TIE_TOL
    assert [a["ok"] for a in record["answers"]] == [True, True, False, True]
    wrong = record["answers"][2]
    assert wrong["first_diff"] == 1 and wrong["first_gap"] > 100 * TIE_TOL  # not a near-tie
    assert wrong["cached_tokens_details"] == {"device": 0, "host": 300, "storage": 0}
    assert wrong["re-asked"]["ok"] and wrong["no-cache"]["ok"]
    assert wrong["prompt"] == list(w.prompts[2])


def test_a_wrong_token_of_stock_sglang_xfails_naming_the_version(fake_judge, ground_truth) -> None:
    judge, _ = fake_judge
    w = shared_prefixes(seed=32, n_prefixes=2, n_requests=4)
    server = FakeServer(ground_truth, "stock", {0, 3})
    with pytest.raises(pytest.xfail.Exception) as e:
        judge(server, w.prompts, _serve(server, w.prompts), N, side="stock")
    message = str(e.value)
    assert f"stock SGLang {sglang_version()}'s own server (stock; hiradix's cache is not in it)" in message, message
    assert f"upstream: stock SGLang {sglang_version()} is wrong here, not hiradix" in message, message
    # stock's cache over hiradix's L3: a wrong answer that read L3 is ours to answer for
    server = FakeServer(ground_truth, "stock-on-l3", {1}, storage=64)
    with pytest.raises(AssertionError, match="hiradix's L3 may be at fault"):
        judge(server, w.prompts, _serve(server, w.prompts), N, side="stock", l3_ours=True)


def test_a_required_run_in_which_no_real_server_test_passes_fails(tmp_path: Path) -> None:
    # CI sets HIRADIX_E2E_REQUIRED for its real-server runs: a run that guards nothing (every
    # test skipped or deselected) must fail and say so, not pass. Planted here: a run of this
    # folder that selects no test.
    import subprocess
    import sys

    from tests.support import REPO, subprocess_env

    env = subprocess_env(repo=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e", "-k", "no_test_is_named_so"]
    cmd += ["--basetemp", str(tmp_path / "run")]
    for required, rc in (("0", pytest.ExitCode.NO_TESTS_COLLECTED), ("1", pytest.ExitCode.TESTS_FAILED)):
        out = subprocess.run(
            cmd, cwd=REPO, env={**env, "HIRADIX_E2E_REQUIRED": required}, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == rc, out.stdout + out.stderr
    assert "HIRADIX_E2E_REQUIRED: no real-server test passed" in out.stdout, out.stdout

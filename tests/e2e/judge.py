"""The judge of a real server's outputs: ground truth (:mod:`tests.e2e.oracle`), and on a
mismatch a diagnosis that names the side at fault (the fixtures are in ``conftest.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.oracle import TIE_TOL, GroundTruth, details
from tests.e2e.server import ServerError, sglang_version


class Reference:
    """The same server build with no prefix cache (``--disable-radix-cache``), started on
    first use: it only helps diagnose a mismatch (the judge is ground truth), so a passing
    run never starts it."""

    def __init__(self, servers: Any) -> None:
        self._servers = servers
        self._server: Any = None

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
        """The no-cache server's answer to ``prompt`` alone, asked now (nothing memoized)."""
        if self._server is None:
            args = ["--disable-radix-cache", "--max-total-tokens", "4096", "--enable-cache-report"]
            self._server = self._servers.start(args, name="no-cache")
        return dict(self._server.generate(list(prompt), max_new_tokens))


#: Every answer judged in this session: how many equal ground truth exactly, and the near-ties
#: accepted (test, server, request, gap), printed at the end of the run.
JUDGED: dict[str, Any] = {"exact": 0, "ties": [], "wrong": 0}


@dataclass
class Mismatch:
    """Answers of one server that disagree with ground truth, diagnosed (:class:`Judge`)."""

    side: str
    server: str
    wrong: list[int]
    blame_ours: bool
    message: str


class Judge:
    """``judge(server, prompts, answers, max_new_tokens, side=...)`` judges a server's answers
    to ``prompts`` against ground truth (:mod:`tests.e2e.oracle`).

    ``side`` says whose cache served them: ``"hiradix"`` (any wrong answer fails the test)
    or ``"stock"`` (stock SGLang's own cache: a wrong answer is upstream's, and the test
    xfails naming the version, unless ``l3_ours`` and the wrong answer read hiradix's L3,
    which then may be at fault and fails the test). :meth:`check` diagnoses without acting,
    for a test that finishes its own checks first; :meth:`act` acts on it later. Each
    answer is counted in ``tally`` (default: the session's :data:`JUDGED`).
    """

    def __init__(
        self, truth: GroundTruth, reference: Any, tmp_path: Path, test: str, tally: dict[str, Any] | None = None
    ) -> None:
        self.truth = truth
        self.tally = JUDGED if tally is None else tally
        self.reference = reference
        self.tmp_path = tmp_path
        self.test = test
        self._reports = 0

    def __call__(
        self,
        server: Any,
        prompts: Sequence[Sequence[int]],
        answers: Sequence[dict[str, Any]],
        max_new_tokens: int,
        *,
        side: str = "hiradix",
        l3_ours: bool = False,
    ) -> None:
        mismatch = self.check(server, prompts, answers, max_new_tokens, side=side, l3_ours=l3_ours)
        if mismatch is not None:
            self.act(mismatch)

    @staticmethod
    def act(mismatch: Mismatch | None) -> None:
        """Fail the test for a mismatch of ours; xfail it for one of stock SGLang's."""
        if mismatch is None:
            return
        if mismatch.blame_ours:
            raise AssertionError(mismatch.message)
        pytest.xfail(mismatch.message)

    def check(
        self,
        server: Any,
        prompts: Sequence[Sequence[int]],
        answers: Sequence[dict[str, Any]],
        max_new_tokens: int,
        *,
        side: str = "hiradix",
        l3_ours: bool = False,
    ) -> Mismatch | None:
        """The answers' mismatches with ground truth, diagnosed and written down (``None``:
        every answer is right)."""
        assert side in ("hiradix", "stock"), side
        assert len(prompts) == len(answers), (len(prompts), len(answers))
        verdicts = [self.truth.judge(p, a["output_ids"]) for p, a in zip(prompts, answers, strict=True)]
        wrong = [i for i, v in enumerate(verdicts) if not v.ok]
        for i, v in enumerate(verdicts):
            if v.exact:
                self.tally["exact"] += 1
            elif v.ok:
                self.tally["ties"].append(
                    f"{self.test} {server.name} #{i}: first differs at {v.first_diff}, gap {v.worst_gap:.2e}"
                )
        self.tally["wrong"] += len(wrong)
        if not wrong:
            return None
        records = [
            {
                "index": i,
                "prompt": [int(t) for t in p],
                "output_ids": [int(t) for t in a["output_ids"]],
                "ground_truth": list(v.truth),
                "first_diff": v.first_diff,
                "first_gap": v.first_gap,
                "worst_gap": v.worst_gap,
                "worst_at": v.worst_at,
                "ok": v.ok,
                **details(a),
            }
            for i, (p, a, v) in enumerate(zip(prompts, answers, verdicts, strict=True))
        ]
        # Re-ask each wrong prompt alone: the server under test (does it repeat itself?) and
        # a no-cache server of the same build (is upstream SGLang itself wrong here?).
        for i in wrong:
            for who, ask in (
                ("re-asked", server.generate if server.alive() else None),
                ("no-cache", self.reference.generate),
            ):
                if ask is None:
                    records[i][who] = {"error": f"{server.name} is no longer running"}
                    continue
                try:
                    again = ask(prompts[i], max_new_tokens)
                except (ServerError, OSError) as e:  # recorded: a diagnosis must not hide the mismatch
                    records[i][who] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                verdict = self.truth.judge(prompts[i], again["output_ids"])
                records[i][who] = {
                    "output_ids": [int(t) for t in again["output_ids"]],
                    "ok": verdict.ok,
                    "first_diff": verdict.first_diff,
                    **details(again),
                }
        version = sglang_version()
        blame_ours = side == "hiradix" or (
            l3_ours and any(((records[i]["cached_tokens_details"] or {}).get("storage") or 0) > 0 for i in wrong)
        )
        self._reports += 1
        path = self.tmp_path / f"mismatch-{self._reports}-{server.name}.json"
        head = {
            "test": self.test,
            "sglang": version,
            "server": server.name,
            "server_args": list(server.args),
            "server_log": str(server.log_path),
            "side": side,
            "ground_truth": "transformers, float32, greedy, each prompt alone (tests/e2e/oracle.py)",
            "tie_tol": TIE_TOL,
            "wrong": wrong,
        }
        # One answer a line: a file to read as much as to parse.
        path.write_text(
            "{\n"
            + "".join(f"{json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
            + '"answers": [\n'
            + ",\n".join(json.dumps(r) for r in records)
            + "\n]}\n"
        )
        who = {
            "hiradix": f"the server with hiradix's cache ({server.name}, SGLang {version})",
            "stock": f"stock SGLang {version}'s own server ({server.name}; hiradix's cache is not in it)",
        }[side]
        lines = [
            f"{who} disagrees with ground truth (transformers, float32, greedy, each prompt alone) "
            f"on {len(wrong)} of {len(answers)} requests {wrong}:"
        ]
        for i in wrong:
            lines.append("  " + _describe(records[i]))
        if side == "stock" and not blame_ours:
            lines.append(f"upstream: stock SGLang {version} is wrong here, not hiradix")
        elif side == "stock":
            lines.append("the wrong requests read hiradix's L3 (storage hits): hiradix's L3 may be at fault")
        if all(
            isinstance(records[i].get("no-cache"), dict) and records[i]["no-cache"].get("ok") is False for i in wrong
        ):
            lines.append(f"the no-cache server of SGLang {version} is wrong on them too: SGLang itself")
        lines.append(f"all answers: {path}")
        return Mismatch(side, server.name, wrong, blame_ours, "\n".join(lines))


def _describe(r: dict[str, Any]) -> str:
    """One wrong request, in a line: where its KV came from, what it said, and what the
    re-asks said."""
    d = r["cached_tokens_details"] or {}
    where = ", ".join(f"{k} {v}" for k, v in d.items() if isinstance(v, int)) or "no details"
    text = (
        f"#{r['index']} ({len(r['prompt'])}-token prompt, cached {r['cached_tokens']}: {where}): "
        f"got {r['output_ids']}, truth {r['ground_truth']}, first differs at output token {r['first_diff']} "
        f"(its logit {r['first_gap']:.3g} below the best there; at most {r['worst_gap']:.3g}, at token "
        f"{r['worst_at']}, given its own earlier tokens)"
    )
    for who in ("re-asked", "no-cache"):
        again = r.get(who) or {}
        if "error" in again:
            text += f"; {who}: {again['error']}"
        else:
            text += f"; {who}: {'right' if again.get('ok') else 'wrong ' + str(again.get('output_ids'))}"
    return text

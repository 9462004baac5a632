"""Ground truth for the real-server tests: the tiny model's greedy outputs computed by
``transformers`` in this process, float32, each prompt alone, no server and no batch.

A server's outputs are judged against it, never against another server's: a second server
can race exactly as the one under test does (a shared no-cache reference server of SGLang
0.5.20, on a loaded machine, once turned three tests red). The other servers only help
diagnose a mismatch (``conftest.py``).

Two float32 programs that sum in different orders may pick different argmaxes where the
top two logits are within rounding of each other. So an output that is not exactly the
ground truth is still right if, given the prompt and the output's own earlier tokens,
every token it chose is within :data:`TIE_TOL` of the best logit: a near-tie, not a
wrong read of KV, which moves logits of this model (weights drawn at scale 0.5) by whole
units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: How far (in logits) below the best a chosen token may be and still count as a tie.
#: Measured on the suite's 224 prompts (8 greedy steps each), no-cache servers against this
#: module: the gap between the top two tokens differs between SGLang and ``transformers``
#: by 8.5e-6 at the median and 5.2e-4 at most (0.5.23); the logits reach about 22. The
#: smallest top-two gap on those steps is 8.6e-4, and SGLang 0.5.18, 0.5.20 and 0.5.23
#: chose exactly ``transformers``' tokens on all of them. A read of wrong KV moves the
#: logits by whole units.
TIE_TOL = 2e-3


@dataclass(frozen=True)
class Verdict:
    """One output judged against ground truth.

    ``truth`` is the greedy output of ``transformers``; ``first_diff`` the first output
    position where the output differs from it (``None``: equal), and ``first_gap`` how far
    the output's token there falls below the best logit (the prompt and the tokens before
    it are the same for both). ``worst_gap`` is, over the output's tokens, the largest
    amount by which the chosen token's logit falls below the best one, given the prompt and
    the output's own earlier tokens (0: every token was an argmax), and ``worst_at`` its
    position.
    """

    truth: tuple[int, ...]
    first_diff: int | None
    first_gap: float
    worst_gap: float
    worst_at: int

    @property
    def exact(self) -> bool:
        return self.first_diff is None

    @property
    def ok(self) -> bool:
        """Equal to ground truth, or differing only where the logits tie."""
        return self.exact or self.worst_gap <= TIE_TOL


class GroundTruth:
    """The tiny model in ``transformers``, float32, on the CPU; greedy outputs memoized.

    Runtime: one forward pass per prompt and one per new token, milliseconds each for a
    two-layer model of hidden size 128.
    """

    def __init__(self, model_path: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self._torch = torch
        self.model = LlamaForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
        self._memo: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[int, ...]:
        """The first ``max_new_tokens`` greedy tokens after ``prompt`` (EOS ignored, as the
        tests ask the servers)."""
        key = (tuple(int(t) for t in prompt), max_new_tokens)
        if key not in self._memo:
            self._memo[key] = self._greedy(key[0], max_new_tokens)
        return self._memo[key]

    def _greedy(self, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        torch = self._torch
        out: list[int] = []
        with torch.inference_mode():
            ids = torch.tensor([prompt], dtype=torch.long)
            step = self.model(input_ids=ids, use_cache=True)
            for _ in range(n):
                token = int(step.logits[0, -1].argmax())
                out.append(token)
                if len(out) == n:
                    break
                step = self.model(
                    input_ids=torch.tensor([[token]], dtype=torch.long),
                    past_key_values=step.past_key_values,
                    use_cache=True,
                )
        return tuple(out)

    def gaps(self, prompt: Sequence[int], output: Sequence[int]) -> list[float]:
        """For each token of ``output``: the best logit minus the token's, given ``prompt``
        and the output's earlier tokens (one forward pass over both)."""
        if not output:
            return []
        torch = self._torch
        with torch.inference_mode():
            ids = torch.tensor([[*prompt, *output]], dtype=torch.long)
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(list(output), dtype=torch.long)[:, None])[:, 0]
            return [float(g) for g in logits.max(dim=1).values - chosen]

    def judge(self, prompt: Sequence[int], output: Sequence[int]) -> Verdict:
        """``output`` (a server's greedy answer to ``prompt``) judged against ground truth.

        Runtime: one forward pass over the prompt and the output when every output token is
        the argmax after the ones before it (greedy by definition: the ground truth); the
        token-by-token greedy decode only for an output that is not.
        """
        output = [int(t) for t in output]
        gaps = self.gaps(prompt, output)
        if all(g == 0.0 for g in gaps):
            return Verdict(tuple(output), None, 0.0, 0.0, 0)
        truth = self.greedy(prompt, len(output))
        first = next((i for i, (a, b) in enumerate(zip(output, truth, strict=True)) if a != b), None)
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        return Verdict(truth, first, 0.0 if first is None else gaps[first], gaps[worst], worst)


def details(answer: dict[str, Any]) -> dict[str, Any]:
    """What a server's answer says about where its prompt's KV came from: SGLang's
    ``cached_tokens`` and ``cached_tokens_details`` (``device``, ``host``, ``storage``), and
    its request id."""
    meta = answer.get("meta_info") or {}
    return {
        "id": meta.get("id"),
        "cached_tokens": meta.get("cached_tokens"),
        "cached_tokens_details": meta.get("cached_tokens_details"),
    }

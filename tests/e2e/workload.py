"""Request workloads for the real-server tests: token-id prompts with shared prefixes, sized
so that a prefix's KV leaves the device pool before it is asked for again."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Token ids the tiny model's tokenizer can decode (its vocabulary has 386 entries; the
#: first three are the special tokens).
LOW, HIGH = 3, 380


@dataclass(frozen=True)
class Workload:
    """``prompts[i]`` is ``prefixes[prefix_of[i]]`` followed by a suffix of its own."""

    prefixes: tuple[tuple[int, ...], ...]
    prompts: tuple[tuple[int, ...], ...]
    prefix_of: tuple[int, ...]
    max_new_tokens: int


def shared_prefixes(
    n_prefixes: int = 8,
    prefix_len: int = 300,
    n_requests: int = 40,
    suffix_len: int = 16,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> Workload:
    """``n_requests`` prompts cycling over ``n_prefixes`` prefixes in order: with fewer
    device slots than all prefixes together, least-recently-used eviction has sent each
    prefix to host by the time the cycle comes back to it, so from the second cycle on
    every request loads its prefix back."""
    rng = np.random.default_rng(seed)
    prefixes = tuple(tuple(int(t) for t in rng.integers(LOW, HIGH, prefix_len)) for _ in range(n_prefixes))
    prompts, owner = [], []
    for i in range(n_requests):
        p = i % n_prefixes
        prompts.append(prefixes[p] + tuple(int(t) for t in rng.integers(LOW, HIGH, suffix_len)))
        owner.append(p)
    return Workload(prefixes, tuple(prompts), tuple(owner), max_new_tokens)


def long_documents(
    head_len: int = 700,
    doc_lens: Sequence[int] = (900, 1100, 1300, 1500, 1700),
    cycles: int = 3,
    suffix_len: int = 16,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> Workload:
    """Long prompts (1.6-2.4k tokens with the defaults) that share a head and differ in a
    long document: ``prefixes[d]`` is the head followed by document ``d``, and the prompts
    cycle over the documents ``cycles`` times, each with a suffix of its own. Asked of a
    device pool smaller than all documents together, the head, hit by every request, stays
    on the device while the documents go to host between cycles: from the second cycle on a
    prompt's prefix is partly on the device and partly on host."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(LOW, HIGH, n))

    head = tokens(head_len)
    prefixes = tuple(head + tokens(n) for n in doc_lens)
    owner = [d for _ in range(cycles) for d in range(len(doc_lens))]
    prompts = tuple(prefixes[d] + tokens(suffix_len) for d in owner)
    return Workload(prefixes, prompts, tuple(owner), max_new_tokens)


def other_suffixes(work: Workload, seed: int, suffix_len: int = 16) -> Workload:
    """``work``'s prefixes, in the same order, each prompt with a new suffix."""
    rng = np.random.default_rng(seed)
    prompts = tuple(
        work.prefixes[p] + tuple(int(t) for t in rng.integers(LOW, HIGH, suffix_len)) for p in work.prefix_of
    )
    return Workload(work.prefixes, prompts, work.prefix_of, work.max_new_tokens)


def serve_all(
    server: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, concurrency: int = 1
) -> list[dict[str, Any]]:
    """Send ``prompts`` to ``server`` (``concurrency`` requests in flight, the answers in
    prompt order) and return its answers."""
    if concurrency == 1:
        return [server.generate(list(p), max_new_tokens) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: server.generate(list(p), max_new_tokens), prompts))


def tier_hits(answers: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Tokens each tier served over ``answers`` (SGLang's ``cached_tokens_details``:
    ``device``, ``host`` and, with an L3, ``storage``), and ``cached`` in all."""
    total = {"device": 0, "host": 0, "storage": 0, "cached": 0}
    for a in answers:
        meta = a["meta_info"]
        total["cached"] += int(meta.get("cached_tokens") or 0)
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            if tier in total and isinstance(n, int):
                total[tier] += n
    return total


@dataclass(frozen=True)
class Conversations:
    """Multi-turn chats behind shared system prompts: conversation ``c`` starts with
    ``prefixes[prefix_of[c]]``, and its turn ``t`` sends the whole conversation so far (the
    prefix, every earlier user message and the server's answer to it) followed by
    ``messages[c][t]``. ``order`` names the conversation of each request, in order (a
    conversation's turns come in turn order).

    First tokens are distinct: among the prefixes, and among the first messages of all
    conversations. So two prompts share exactly their system prompt, or, within one
    conversation, all of the earlier turn: the prompts diverge only where a prefix ends.
    """

    prefixes: tuple[tuple[int, ...], ...]
    prefix_of: tuple[int, ...]
    messages: tuple[tuple[tuple[int, ...], ...], ...]
    order: tuple[int, ...]
    max_new_tokens: int


def conversations(
    n_prefixes: int = 6,
    prefix_len: int = 512,
    n_conversations: int = 12,
    turns: int = 3,
    message_len: int = 32,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> Conversations:
    """``n_conversations`` chats of ``turns`` turns, each behind one of ``n_prefixes``
    system prompts (drawn uniformly), their turns interleaved in a seeded random order."""
    rng = np.random.default_rng(seed)
    firsts = [int(t) for t in rng.permutation(np.arange(LOW, HIGH))[: n_prefixes + n_conversations]]

    def tokens(first: int | None, n: int) -> tuple[int, ...]:
        rest = tuple(int(t) for t in rng.integers(LOW, HIGH, n - (first is not None)))
        return rest if first is None else (first, *rest)

    prefixes = tuple(tokens(firsts[p], prefix_len) for p in range(n_prefixes))
    prefix_of = tuple(int(p) for p in rng.integers(0, n_prefixes, n_conversations))
    messages = tuple(
        tuple(tokens(firsts[n_prefixes + c] if t == 0 else None, message_len) for t in range(turns))
        for c in range(n_conversations)
    )
    order = [c for c in range(n_conversations) for _ in range(turns)]
    rng.shuffle(order)  # the turns of one conversation are taken in order whatever their slots
    return Conversations(prefixes, prefix_of, messages, tuple(order), max_new_tokens)


def serve_conversations(server: Any, work: Conversations) -> tuple[list[tuple[int, ...]], list[dict[str, Any]]]:
    """Serve ``work``'s requests one at a time, in order, each turn carrying the server's
    earlier answers of its conversation; returns the prompts sent and the answers."""
    history = [list(work.prefixes[p]) for p in work.prefix_of]
    turn = [0] * len(history)
    prompts, answers = [], []
    for c in work.order:
        prompt = history[c] + list(work.messages[c][turn[c]])
        answer = server.generate(prompt, work.max_new_tokens)
        history[c] = prompt + list(answer["output_ids"])
        turn[c] += 1
        prompts.append(tuple(prompt))
        answers.append(answer)
    return prompts, answers

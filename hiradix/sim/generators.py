"""Workloads: the Mooncake trace and seeded synthetic generators, all yielding
:class:`~hiradix.sim.trace.TraceRequest` records like the trace reader does.

Every workload is a small frozen dataclass; iterating it yields requests in timestamp
order (milliseconds), numbered from 1 in :attr:`TraceRequest.line`. Iterating twice, or
in another process, yields the same requests: all randomness comes from
``numpy.random.default_rng(seed)`` created afresh by ``__iter__``. Being plain data, a
workload pickles, which is how :mod:`hiradix.sim.sweep` ships it to worker processes.

=================  ==================================================================
``trace``          :class:`MooncakeWorkload`: a Mooncake-format ``.jsonl`` trace.
``system-prompt``  :class:`SystemPromptWorkload`: one-shot requests behind a few shared
                   system prompts with Zipf popularity.
``chat``           :class:`ChatWorkload`: multi-turn conversations; each turn resends
                   the whole conversation so far (system prompt, earlier turns and
                   answers) plus a new user message.
``agent``          :class:`AgentWorkload`: agent loops; each step resends the context
                   grown by the previous action and a (long) tool output, quickly.
``azure-conv``,    :class:`AzureWorkload`: arrival times and input/output lengths taken
``azure-code``     verbatim from the Azure LLM inference traces (2023), with synthetic
                   shared prefixes (the traces carry no prefix information).
=================  ==================================================================

How prompts become block ids
----------------------------
As in the Mooncake trace, ``hash_ids`` has one id per 512-token block of the prompt and
an id names the *whole prefix up to and including* that block: two prompts share block
``i`` only if they share every block before it. The generators keep each context (a
system prompt, a conversation, an agent's scratchpad) as a list of full-block ids plus
a partial tail. Appending tokens gives every block it completes a fresh id, and the
partial tail gets a fresh id each time it changes, because its content differs. So a
conversation's next turn shares all the full blocks of the previous turn's prompt but
not its partial last block: the same 512-token granularity as the real trace, which
loses at most 511 reusable tokens per request.

Lengths are drawn log-uniformly from ``(low, high)`` ranges (inclusive, integer): heavy
enough to mix short and long requests, with no parameter beyond the bounds. Arrivals are
Poisson at the given rate; think and tool times are log-uniform too.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hiradix.sim.trace import BLOCK_TOKENS, MAX_BLOCK_ID, MooncakeTrace, TraceError, TraceRequest

AZURE_FILES = {"azure-conv": "AzureLLMInferenceTrace_conv.csv", "azure-code": "AzureLLMInferenceTrace_code.csv"}
"""Workload name -> file name of the Azure LLM inference trace (in ``shared/traces/``)."""

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

Range = tuple[float, float]


# ----------------------------------------------------------------------------- helpers
class _BlockIds:
    """Hands out dense block ids 0, 1, 2, ... and refuses to pass :data:`MAX_BLOCK_ID`."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def new(self) -> int:
        if self.next > MAX_BLOCK_ID:
            raise ValueError(
                f"the workload needs more than {MAX_BLOCK_ID + 1:,} distinct 512-token blocks "
                "(token ids would overflow int32): ask for fewer requests or shorter prompts"
            )
        self.next += 1
        return self.next - 1


class _Context:
    """A growing token sequence as full-block ids plus a partial tail (see the module
    docstring). ``fork`` shares the past; ``append`` never changes a full block."""

    __slots__ = ("_ids", "_tail", "blocks", "length")

    def __init__(self, ids: _BlockIds, blocks: list[int] | None = None, length: int = 0) -> None:
        self._ids = ids
        self.blocks = blocks if blocks is not None else []
        self.length = length
        self._tail: int | None = None  # id of the partial last block, made on demand

    def fork(self, length: int | None = None) -> _Context:
        """A copy, optionally cut to its first ``length`` tokens. A cut inside a block
        makes a new partial tail (different content, so a different id)."""
        if length is None or length >= self.length:
            out = _Context(self._ids, list(self.blocks), self.length)
            out._tail = self._tail
            return out
        return _Context(self._ids, self.blocks[: length // BLOCK_TOKENS], length)

    def append(self, tokens: int) -> None:
        full = self.length // BLOCK_TOKENS
        self.length += tokens
        self.blocks.extend(self._ids.new() for _ in range(full, self.length // BLOCK_TOKENS))
        if tokens:
            self._tail = None

    def hash_ids(self) -> tuple[int, ...]:
        if self.length % BLOCK_TOKENS == 0:
            return tuple(self.blocks)
        if self._tail is None:
            self._tail = self._ids.new()
        return (*self.blocks, self._tail)


def _check_range(name: str, value: Range, minimum: float = 0) -> None:
    low, high = value
    if not (minimum <= low <= high) or not math.isfinite(high):
        raise ValueError(f"{name} must be a range (low, high) with {minimum} <= low <= high, got {value!r}")


def _log_uniform(rng: np.random.Generator, value: Range) -> float:
    low, high = value
    if low <= 0 or low == high:
        return float(rng.uniform(low, high)) if low != high else float(low)
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def _tokens(rng: np.random.Generator, value: Range) -> int:
    return round(_log_uniform(rng, value))


def _zipf_weights(n: int, skew: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** skew
    return weights / weights.sum()


def _request(number: int, time_s: float, context: _Context, output: int) -> TraceRequest:
    return TraceRequest(number, round(time_s * 1000, 3), context.length, output, context.hash_ids())


# A session generator yields (context, output tokens, seconds until its next request).
_Session = Iterator[tuple[_Context, int, float]]


def _interleave(
    rng: np.random.Generator, rate: float, new_session: Callable[[], _Session], limit: int
) -> Iterator[TraceRequest]:
    """Merge the requests of sessions that start as a Poisson process of ``rate`` per
    second, by time, until ``limit`` requests. A session is created when its start
    comes, so every random draw happens in time order and the result is deterministic;
    ties go to the earlier session."""
    heap: list[tuple[float, int, _Session]] = []
    next_start = rng.exponential(1 / rate)
    sessions = emitted = 0
    while emitted < limit:
        if not heap or next_start <= heap[0][0]:
            heapq.heappush(heap, (next_start, sessions, new_session()))
            sessions += 1
            next_start += rng.exponential(1 / rate)
            continue
        t, i, session = heapq.heappop(heap)
        step = next(session, None)
        if step is None:
            continue
        context, output, delay = step
        emitted += 1
        yield _request(emitted, t, context, output)
        heapq.heappush(heap, (t + delay, i, session))


class Workload:
    """Base of the workloads: a frozen dataclass that yields :class:`TraceRequest`.

    Subclasses set :attr:`name` (the ``hiradix sim --workload`` value) and implement
    ``__iter__``.
    """

    name: ClassVar[str] = ""

    def __iter__(self) -> Iterator[TraceRequest]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The workload's name and parameters, for reports (JSON-ready)."""
        params = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}  # type: ignore[call-overload]
        return {"workload": self.name, **params}

    def count(self) -> int | None:
        """How many requests iteration yields at most (for progress bars), if known cheaply."""
        return getattr(self, "requests", None)


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class MooncakeWorkload(Workload):
    """A Mooncake-format trace file (see :class:`~hiradix.sim.trace.MooncakeTrace`)."""

    name: ClassVar[str] = "trace"
    path: Path
    limit: int | None = None
    skip_bad: bool = False

    def trace(self) -> MooncakeTrace:
        """The underlying reader (it counts skipped lines in ``bad_lines``)."""
        return MooncakeTrace(self.path, limit=self.limit, skip_bad=self.skip_bad)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.trace())

    def count(self) -> int | None:
        return self.trace().count_lines()


@dataclass(frozen=True)
class SystemPromptWorkload(Workload):
    """One-shot requests, each a shared system prompt plus a unique user message.

    ``prompts`` system prompts of ``prompt_tokens`` tokens are picked with Zipf
    popularity of exponent ``skew`` (prompt ``k`` with weight ``1 / k**skew``), so a
    few are hot and the rest form a long tail. Arrivals are Poisson at ``rate`` per
    second.
    """

    name: ClassVar[str] = "system-prompt"
    requests: int = 2000
    seed: int = 0
    prompts: int = 32
    prompt_tokens: Range = (1000, 8000)
    user_tokens: Range = (20, 2000)
    output_tokens: Range = (20, 600)
    skew: float = 1.0
    rate: float = 20.0

    def __post_init__(self) -> None:
        _check_common(self)
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")

    def __iter__(self) -> Iterator[TraceRequest]:
        rng = np.random.default_rng(self.seed)
        ids = _BlockIds()
        system = []
        for _ in range(self.prompts):
            context = _Context(ids)
            context.append(_tokens(rng, self.prompt_tokens))
            system.append(context)
        weights = _zipf_weights(self.prompts, self.skew)
        t = 0.0
        for number in range(1, self.requests + 1):
            t += rng.exponential(1 / self.rate)
            context = system[int(rng.choice(self.prompts, p=weights))].fork()
            context.append(_tokens(rng, self.user_tokens))
            yield _request(number, t, context, _tokens(rng, self.output_tokens))


@dataclass(frozen=True)
class ChatWorkload(Workload):
    """Multi-turn chats: each turn resends the whole conversation plus a new message.

    Conversations start as a Poisson process of ``rate`` per second, each behind one
    of ``system_prompts`` shared system prompts (uniformly chosen), and last
    ``turns`` turns. Turn ``k`` sends system prompt, then every earlier user message
    and answer, then a new user message of ``user_tokens``; its answer
    (``output_tokens``) joins the conversation, and the next turn comes
    ``think_time_s`` seconds later. Turns of different conversations interleave.
    """

    name: ClassVar[str] = "chat"
    requests: int = 2000
    seed: int = 0
    system_prompts: int = 4
    system_tokens: Range = (500, 3000)
    turns: Range = (2, 16)
    user_tokens: Range = (20, 1500)
    output_tokens: Range = (50, 800)
    think_time_s: Range = (5.0, 120.0)
    rate: float = 1.0

    def __post_init__(self) -> None:
        _check_common(self)
        _check_range("turns", self.turns, 1)
        _check_range("think_time_s", self.think_time_s)
        if self.system_prompts < 1:
            raise ValueError(f"system_prompts must be >= 1, got {self.system_prompts}")

    def __iter__(self) -> Iterator[TraceRequest]:
        rng = np.random.default_rng(self.seed)
        ids = _BlockIds()
        system = []
        for _ in range(self.system_prompts):
            context = _Context(ids)
            context.append(_tokens(rng, self.system_tokens))
            system.append(context)

        def chat(context: _Context, turns: int) -> _Session:
            for turn in range(turns):
                context.append(_tokens(rng, self.user_tokens))
                output = _tokens(rng, self.output_tokens)
                yield context, output, _log_uniform(rng, self.think_time_s)
                if turn + 1 < turns:
                    context.append(output)

        def start() -> _Session:
            return chat(system[int(rng.integers(self.system_prompts))].fork(), _tokens(rng, self.turns))

        yield from _interleave(rng, self.rate, start, self.requests)


@dataclass(frozen=True)
class AgentWorkload(Workload):
    """Agent loops: a long shared tool-description prompt, a task, then steps.

    Sessions start as a Poisson process of ``rate`` per second behind one of
    ``agents`` shared system prompts of ``system_tokens`` (Zipf popularity of exponent
    ``skew``). Each step sends the whole context; its output (an action of
    ``action_tokens``) and the tool's result (``tool_tokens``) are appended, and the
    next step arrives ``tool_latency_s`` later. A session ends after ``steps`` steps
    or when its context would pass ``max_context`` tokens.
    """

    name: ClassVar[str] = "agent"
    requests: int = 2000
    seed: int = 0
    agents: int = 4
    system_tokens: Range = (2000, 8000)
    task_tokens: Range = (50, 1000)
    steps: Range = (3, 30)
    action_tokens: Range = (20, 400)
    tool_tokens: Range = (50, 6000)
    tool_latency_s: Range = (0.2, 10.0)
    max_context: int = 100_000
    skew: float = 1.0
    rate: float = 0.5

    def __post_init__(self) -> None:
        _check_common(self)
        for field in ("task_tokens", "action_tokens", "tool_tokens", "tool_latency_s"):
            _check_range(field, getattr(self, field))
        _check_range("steps", self.steps, 1)
        if self.agents < 1:
            raise ValueError(f"agents must be >= 1, got {self.agents}")
        if self.max_context < self.system_tokens[1] + self.task_tokens[1]:
            raise ValueError(f"max_context {self.max_context} cannot hold the largest system prompt and task")

    def __iter__(self) -> Iterator[TraceRequest]:
        rng = np.random.default_rng(self.seed)
        ids = _BlockIds()
        system = []
        for _ in range(self.agents):
            context = _Context(ids)
            context.append(_tokens(rng, self.system_tokens))
            system.append(context)
        weights = _zipf_weights(self.agents, self.skew)

        def loop(context: _Context, steps: int) -> _Session:
            context.append(_tokens(rng, self.task_tokens))
            for step in range(steps):
                action = _tokens(rng, self.action_tokens)
                yield context, action, _log_uniform(rng, self.tool_latency_s)
                grown = action + _tokens(rng, self.tool_tokens)
                if step + 1 == steps or context.length + grown > self.max_context:
                    return
                context.append(grown)

        def start() -> _Session:
            return loop(system[int(rng.choice(self.agents, p=weights))].fork(), _tokens(rng, self.steps))

        yield from _interleave(rng, self.rate, start, self.requests)


def _check_common(workload: Any) -> None:
    if workload.requests < 0:
        raise ValueError(f"requests must be >= 0, got {workload.requests}")
    if not workload.rate > 0:
        raise ValueError(f"rate must be > 0, got {workload.rate}")
    for f in fields(workload):
        if f.name.endswith("_tokens") and isinstance(getattr(workload, f.name), tuple):
            _check_range(f.name, getattr(workload, f.name))


# ------------------------------------------------------------------------------- azure
@dataclass(frozen=True)
class AzureLengths:
    """The columns of an Azure LLM inference trace CSV: arrival times in milliseconds
    from the first request, prompt (context) and output (generated) lengths."""

    timestamps_ms: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.timestamps_ms)


def _parse_timestamp(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:17:03.9799600`` (7 fractional digits,
    which ``datetime.fromisoformat`` rejects before Python 3.11)."""
    whole, _, fraction = text.strip().partition(".")
    if fraction and not fraction.isdigit():
        raise ValueError(f"bad TIMESTAMP {text!r}")
    try:
        seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        raise ValueError(f"bad TIMESTAMP {text!r}: expected YYYY-MM-DD HH:MM:SS[.fraction]") from None
    return seconds + (float("0." + fraction) if fraction else 0.0)


def read_azure_csv(path: str | Path, limit: int | None = None) -> AzureLengths:
    """Read an Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Raises :class:`FileNotFoundError` with a pointer to the data set when the file is
    missing, and :class:`~hiradix.sim.trace.TraceError` naming the line for a wrong
    header, a malformed or negative field, or timestamps that go backwards.
    Runtime complexity: ``O(rows)``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Azure trace not found: {path} (the AzureLLMInferenceTrace_{{conv,code}}.csv files of "
            "github.com/Azure/AzurePublicDataset belong in ../shared/traces/; pass --trace PATH)"
        )
    times: list[float] = []
    context: list[int] = []
    generated: list[int] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        header = [c.strip() for c in f.readline().split(",")]
        if tuple(header) != AZURE_COLUMNS:
            raise TraceError(str(path), 1, f"expected the header {','.join(AZURE_COLUMNS)}, got {','.join(header)!r}")
        for number, line in enumerate(f, start=2):
            if not line.strip():
                continue
            if limit is not None and len(times) >= limit:
                break
            cells = line.split(",")
            if len(cells) != 3:
                raise TraceError(str(path), number, f"expected 3 comma-separated fields, got {len(cells)}")
            try:
                t = _parse_timestamp(cells[0])
                c, g = int(cells[1]), int(cells[2])
            except ValueError as exc:
                raise TraceError(str(path), number, str(exc)) from None
            if c < 0 or g < 0:
                raise TraceError(str(path), number, f"negative token count ({c}, {g})")
            if times and t < times[-1]:
                raise TraceError(str(path), number, "TIMESTAMP goes backwards (the trace must be sorted)")
            times.append(t)
            context.append(c)
            generated.append(g)
    stamps = np.asarray(times, dtype=np.float64)
    return AzureLengths(
        (stamps - stamps[0]) * 1000 if len(stamps) else stamps,
        np.asarray(context, dtype=np.int64),
        np.asarray(generated, dtype=np.int64),
    )


@dataclass(frozen=True)
class AzureWorkload(Workload):
    """Arrivals and lengths of an Azure LLM inference trace, with synthetic prefixes.

    The Azure traces give only when each request came and how long its prompt and
    output were. Each request here takes those verbatim (timestamps scaled by
    ``time_scale``) and gets a shared prefix: one of ``prefixes`` prefixes of
    ``prefix_tokens`` (Zipf popularity of exponent ``skew``), cut to the prompt when
    the prompt is shorter; the rest of the prompt is unique. ``requests`` limits the
    number read (``None``: all).
    """

    name: ClassVar[str] = "azure"
    path: Path
    requests: int | None = None
    seed: int = 0
    prefixes: int = 16
    prefix_tokens: Range = (200, 2000)
    skew: float = 1.0
    time_scale: float = 1.0
    kind: str = "azure"  # the name reports use: azure-conv, azure-code, ...

    def __post_init__(self) -> None:
        if self.requests is not None and self.requests < 0:
            raise ValueError(f"requests must be >= 0, got {self.requests}")
        if self.prefixes < 1:
            raise ValueError(f"prefixes must be >= 1, got {self.prefixes}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        _check_range("prefix_tokens", self.prefix_tokens)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "workload": self.kind}

    def __iter__(self) -> Iterator[TraceRequest]:
        lengths = read_azure_csv(self.path, self.requests)
        rng = np.random.default_rng(self.seed)
        ids = _BlockIds()
        shared = []
        for _ in range(self.prefixes):
            context = _Context(ids)
            context.append(_tokens(rng, self.prefix_tokens))
            shared.append(context)
        weights = _zipf_weights(self.prefixes, self.skew)
        picks = rng.choice(self.prefixes, size=len(lengths), p=weights)
        cuts: dict[tuple[int, int], _Context] = {}  # one id for the same cut of a prefix
        for i in range(len(lengths)):
            prompt = int(lengths.context_tokens[i])
            prefix = shared[int(picks[i])]
            if prompt > prefix.length:
                context = prefix.fork()
                context.append(prompt - prefix.length)
            else:
                context = cuts.setdefault((int(picks[i]), prompt), prefix.fork(prompt))
            stamp = round(float(lengths.timestamps_ms[i]) * self.time_scale, 3)
            yield TraceRequest(i + 1, stamp, prompt, int(lengths.generated_tokens[i]), context.hash_ids())

    def count(self) -> int | None:
        return self.requests


# ---------------------------------------------------------------------------- registry
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "trace": MooncakeWorkload,
    "chat": ChatWorkload,
    "agent": AgentWorkload,
    "system-prompt": SystemPromptWorkload,
    "azure-conv": AzureWorkload,
    "azure-code": AzureWorkload,
}
"""``--workload`` name -> workload class."""


def make_workload(
    name: str,
    *,
    trace_dir: str | Path,
    path: str | Path | None = None,
    requests: int | None = None,
    seed: int = 0,
    skip_bad: bool = False,
) -> Workload:
    """The workload ``name`` (a key of :data:`WORKLOADS`) with the CLI's options.

    ``path`` is the file for ``trace`` and ``azure-*`` (default: the usual file in
    ``trace_dir``); ``requests`` limits the trace workloads and sets the size of the
    synthetic ones (default 2000).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    if name == "trace":
        return MooncakeWorkload(Path(path or Path(trace_dir) / "conversation_trace.jsonl"), requests, skip_bad)
    if name in AZURE_FILES:
        return AzureWorkload(Path(path or Path(trace_dir) / AZURE_FILES[name]), requests, seed, kind=name)
    cls = WORKLOADS[name]
    return cls(**({"seed": seed} if requests is None else {"requests": requests, "seed": seed}))

"""Streaming loader for the Mooncake trace format (``../shared/traces/README.md``).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``hash_ids`` are cumulative prefix hashes of 512-token blocks, remapped to dense
integers: two requests share block ``i`` only if they share every block before it.

Token ids
---------
Block ``h`` becomes the token ids ``h * 512 + j`` for ``j`` in ``0 .. 511``, the last
block of a request cut to ``input_length``. Distinct blocks then occupy disjoint token
ranges, so two prompts share exactly their common blocks as a token prefix, and the
tree splits only where the trace says the prompts diverge. Token ids are ``int32``,
which bounds block ids by :data:`MAX_BLOCK_ID` (4,194,303; the conversation trace's
largest is 182,789); a larger id is reported as a bad line rather than wrapped, since
wrapping could make two different blocks share tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_TOKENS = 512
"""Tokens per trace block."""

MAX_BLOCK_ID = (2**31 - 1) // BLOCK_TOKENS
"""Largest block id whose token ids ``h * 512 + 511`` still fit in ``int32``."""

_OFFSETS = np.arange(BLOCK_TOKENS, dtype=np.int32)
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file and line."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}")
        self.path = path
        self.line = line
        self.problem = problem


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``timestamp`` is in milliseconds; lengths are in tokens; ``hash_ids`` has one entry
    per 512-token block, ``ceil(input_length / 512)`` in all. ``line`` is the 1-based
    line of the file it came from.
    """

    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens(self) -> np.ndarray:
        """The prompt as ``int32`` token ids (see the module docstring).

        Runtime complexity: ``O(input_length)``.

        >>> TraceRequest(1, 0, 514, 1, (0, 3)).tokens()[[0, 511, 512, 513]].tolist()
        [0, 511, 1536, 1537]
        """
        blocks = np.asarray(self.hash_ids, dtype=np.int32)
        return (blocks[:, None] * BLOCK_TOKENS + _OFFSETS).ravel()[: self.input_length]


def _is_int(x: Any) -> bool:
    # bool is an int subclass, but ``true`` is not a length.
    return isinstance(x, int) and not isinstance(x, bool)


def parse_line(text: str | bytes, line: int = 0) -> TraceRequest:
    """Parse and validate one trace line; ``line`` is recorded in the result.

    Raises :class:`ValueError` naming the problem: invalid JSON, not an object, a missing
    field, a wrong type, a negative number, a block id over :data:`MAX_BLOCK_ID`, or a
    ``hash_ids`` length other than ``ceil(input_length / 512)``.
    Runtime complexity: ``O(len(text))``.
    """
    record = _load_record(text)
    _check_numbers(record)
    hash_ids = record["hash_ids"]
    _check_hash_ids(hash_ids, record["input_length"])
    return TraceRequest(line, record["timestamp"], record["input_length"], record["output_length"], tuple(hash_ids))


def _load_record(text: str | bytes) -> dict[str, Any]:
    """The line's JSON object, with every field of :data:`_FIELDS` (``ValueError``)."""
    try:
        record = json.loads(text)
    except UnicodeDecodeError:  # a ValueError too, but its message reads badly
        raise ValueError("not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for field in _FIELDS:
        if field not in record:
            raise ValueError(f"missing field {field!r}")
    return record


def _check_numbers(record: dict[str, Any]) -> None:
    """``timestamp`` a finite number, the lengths integers, none negative (``ValueError``)."""
    timestamp = record["timestamp"]
    if not (_is_int(timestamp) or isinstance(timestamp, float)) or not math.isfinite(timestamp):
        raise ValueError(f"'timestamp' must be a finite number, got {timestamp!r}")
    for field in ("timestamp", "input_length", "output_length"):
        value = record[field]
        if field != "timestamp" and not _is_int(value):
            raise ValueError(f"{field!r} must be an integer, got {value!r}")
        if value < 0:
            raise ValueError(f"{field!r} is negative ({value})")


def _check_hash_ids(hash_ids: Any, input_length: int) -> None:
    """``hash_ids`` a list of ``ceil(input_length / 512)`` block ids in
    ``0..MAX_BLOCK_ID`` (``ValueError``)."""
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        raise ValueError("'hash_ids' must be a list of integers")
    expected = -(-input_length // BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise ValueError(
            f"{len(hash_ids)} hash_ids for input_length {input_length}: "
            f"expected ceil({input_length} / {BLOCK_TOKENS}) = {expected}"
        )
    if hash_ids and (min(hash_ids) < 0 or max(hash_ids) > MAX_BLOCK_ID):
        bad = min(hash_ids) if min(hash_ids) < 0 else max(hash_ids)
        raise ValueError(f"block id {bad} is out of range 0..{MAX_BLOCK_ID} (its token ids would not fit in int32)")


class MooncakeTrace:
    """A Mooncake trace file, read lazily: iterate to get :class:`TraceRequest` objects.

    Parameters
    ----------
    path:
        The ``.jsonl`` file. Blank lines are ignored.
    limit:
        Stop after this many requests (``None``: all).
    skip_bad:
        Skip bad lines and count them in :attr:`bad_lines` instead of raising
        :class:`TraceError` at the first one. :attr:`first_error` keeps the first.

    Each iteration reopens the file and resets the counters. Memory is ``O(1)`` in the
    trace length; time is ``O(bytes)``.
    """

    def __init__(self, path: str | Path, *, limit: int | None = None, skip_bad: bool = False) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.path = Path(path)
        self.limit = limit
        self.skip_bad = skip_bad
        self.bad_lines = 0
        self.first_error: TraceError | None = None

    def __iter__(self) -> Iterator[TraceRequest]:
        self.bad_lines = 0
        self.first_error = None
        if self.limit == 0:
            return
        served = 0
        with self.path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    request = parse_line(raw, number)
                except ValueError as exc:
                    error = TraceError(str(self.path), number, str(exc))
                    if not self.skip_bad:
                        raise error from None
                    self.bad_lines += 1
                    self.first_error = self.first_error or error
                    continue
                yield request
                served += 1
                if served == self.limit:
                    return

    def count_lines(self) -> int:
        """Non-blank lines in the file, capped at ``limit``: an upper bound on the number
        of requests, for progress bars. Runtime complexity: ``O(bytes)``, no parsing."""
        with self.path.open("rb") as f:
            n = sum(1 for raw in f if raw.strip())
        return n if self.limit is None else min(n, self.limit)

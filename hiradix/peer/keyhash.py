"""Key hashes of the peer cache: one SHA-256 per key serves both placement and verification.

A key's SHA-256 (``str`` keys hashed as their UTF-8 bytes) is the 32-byte digest a
published-pool slot header carries (:func:`key_digest`), and its first 8 bytes read
big-endian are the key's position on the consistent-hash ring (:func:`hash64`). Both are
deterministic across processes and runs, unlike Python's salted ``hash()``.

The batch forms :func:`hash64_many` and :func:`key_digests` come from the compiled
:mod:`hiradix.peer._hash` (one C loop, SHA-NI where the CPU has it) unless
``HIRADIX_PUREPYTHON=1`` is set or the extension is not built; the fallback over
:mod:`hashlib` gives identical values.

>>> key_digest("abc")[:8] == hash64("abc").to_bytes(8, "big")
True
>>> [int(h) for h in hash64_many(["abc", b"xyz"])] == [hash64("abc"), hash64(b"xyz")]
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from hiradix._native import load

__all__ = ["compiled", "hash64", "hash64_many", "key_digest", "key_digests"]

Key = str | bytes

_hash: Any = load("hiradix.peer._hash")


def compiled() -> bool:
    """Whether the batch hashes run in the compiled extension."""
    return _hash is not None


def _raw(key: Key) -> bytes:
    # bytes(memoryview(...)), not bytes(...): an int must not become that many zero bytes.
    return key.encode("utf-8") if isinstance(key, str) else bytes(memoryview(key))


def key_digest(key: Key) -> bytes:
    """The 32-byte SHA-256 of ``key`` stored in slot headers. Runtime complexity: ``O(len(key))``."""
    return hashlib.sha256(_raw(key)).digest()


def hash64(key: Key) -> int:
    """The ring position of ``key``: its digest's first 8 bytes, big-endian.

    Runtime complexity: ``O(len(key))``.

    >>> hash64("abc") == hash64(b"abc")
    True
    """
    return int.from_bytes(hashlib.sha256(_raw(key)).digest()[:8], "big")


def hash64_many(keys: Sequence[Key]) -> np.ndarray:
    """:func:`hash64` of each key as a ``uint64`` array (the first 8 bytes of each row of
    :func:`key_digests`, big-endian).

    Runtime complexity: ``O(total key bytes)``; compiled, a few tens of nanoseconds per
    short key.
    """
    return np.ascontiguousarray(key_digests(keys)[:, :8]).view(">u8").ravel().astype(np.uint64)


def key_digests(keys: Sequence[Key]) -> np.ndarray:
    """:func:`key_digest` of each key as the rows of an ``(n, 32)`` ``uint8`` array.

    Runtime complexity: ``O(total key bytes)``.
    """
    if _hash is not None:
        return _hash.key_digests(keys)  # type: ignore[no-any-return]
    return _key_digests_py(keys)


def _key_digests_py(keys: Sequence[Key]) -> np.ndarray:
    sha = hashlib.sha256
    raw = b"".join([sha(_raw(k)).digest() for k in keys])
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32).copy()

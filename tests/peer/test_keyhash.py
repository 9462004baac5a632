"""Key hashes: the compiled batch hashes equal the hashlib fallback, key by key."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hiradix.peer import keyhash
from hiradix.peer.keyhash import hash64, hash64_many, key_digest, key_digests

try:
    from hiradix.peer import _hash
except ImportError:  # HIRADIX_PUREPYTHON builds: only the fallback is tested
    _hash = None  # type: ignore[assignment]

needs_ext = pytest.mark.skipif(_hash is None, reason="hiradix.peer._hash is not built")

keys_st = st.lists(st.one_of(st.text(max_size=200), st.binary(max_size=200)), max_size=40)


def _mixed_keys(n: int, seed: int) -> list[str | bytes]:
    rng = random.Random(seed)
    out: list[str | bytes] = ["", "é€𝄞", "a" * 55, "a" * 56, "a" * 64, "a" * 119, "a" * 120]
    for _ in range(n):
        size = rng.choice([0, 1, 20, 64, 65, 300])
        if rng.random() < 0.2:
            out.append(rng.randbytes(size))
        else:
            out.append(
                "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(160, 0x2FFF)])) for _ in range(size))
            )
    return out


def test_values_are_sha256() -> None:
    assert key_digest("abc") == hashlib.sha256(b"abc").digest()
    assert hash64("abc") == int.from_bytes(hashlib.sha256(b"abc").digest()[:8], "big")
    assert hash64("é") == hash64("é".encode())


@given(keys_st)
@settings(max_examples=60, deadline=None)
def test_batch_equals_single(keys: list[str | bytes]) -> None:
    h = hash64_many(keys)
    d = key_digests(keys)
    assert h.dtype == np.uint64 and h.shape == (len(keys),)
    assert d.dtype == np.uint8 and d.shape == (len(keys), 32)
    assert [int(x) for x in h] == [hash64(k) for k in keys]
    assert [row.tobytes() for row in d] == [key_digest(k) for k in keys]


@needs_ext
@pytest.mark.parametrize("n", [0, 1, 128, 5000])  # 5000 keys cross NOGIL_MIN_BLOCKS
def test_compiled_matches_pure(n: int) -> None:
    keys = _mixed_keys(n, seed=n)
    assert np.array_equal(_hash.key_digests(keys), keyhash._key_digests_py(keys))
    assert np.array_equal(_hash.key_digests(tuple(keys)), _hash.key_digests(iter(keys)))


@needs_ext
def test_compiled_accepts_buffers_like_the_fallback() -> None:
    keys = [bytearray(b"xy"), memoryview(b"xyz")]
    assert [r.tobytes() for r in _hash.key_digests(keys)] == [key_digest(b"xy"), key_digest(b"xyz")]


@pytest.mark.parametrize("fn", [hash64_many, key_digests, keyhash._key_digests_py])
def test_bad_keys_raise_alike(fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnicodeEncodeError):
        fn(["ok", "\ud800"])  # a lone surrogate has no UTF-8 form
    with pytest.raises(TypeError):
        fn([3])  # not bytes-like: never "three zero bytes"

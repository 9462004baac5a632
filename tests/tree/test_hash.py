"""Page hashes: bit-compatible with SGLang's ``get_hash_str`` chain (DESIGN.md), for both
implementations, checked against an independent ``hashlib``/``struct`` oracle."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest

import hiradix
from tests.support import IMPLEMENTATIONS

HASH_OF_1234 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"


# ----------------------------------------------------------------------------- helpers
def oracle_chain(tokens: list[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """SHA-256 per full page of little-endian uint32 tokens, each seeded with the previous
    page's raw 32-byte digest (SGLang's ``get_hash_str``)."""
    out = []
    prev = bytes.fromhex(prior_hash) if prior_hash else b""
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        page = tokens[start : start + page_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(page)}I", *(t & 0xFFFFFFFF for t in page))).digest()
        out.append(prev.hex())
    return out


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request):
    """``hiradix.tree._reference`` and, when available, ``hiradix.tree._core``."""
    return IMPLEMENTATIONS[request.param]


# ----------------------------------------------------------------------------- tests
def test_the_published_vector_hashes_as_sglang(impl):
    assert impl.get_hash_str([1, 2, 3, 4]) == HASH_OF_1234


def test_the_package_level_get_hash_str_gives_the_published_vector():
    assert hiradix.get_hash_str([1, 2, 3, 4]) == HASH_OF_1234


def test_get_hash_str_chains_on_the_prior_hash(impl):
    first = impl.get_hash_str([1, 2, 3, 4])
    assert impl.get_hash_str([5, 6, 7, 8], first) == oracle_chain([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]


@pytest.mark.parametrize("page_size", [1, 2, 3, 16, 64])
def test_page_hashes_match_the_hashlib_chain(impl, page_size):
    rng = random.Random(page_size)
    for _ in range(60):
        n = rng.randrange(0, 5 * page_size + 3)
        tokens = [rng.randrange(0, 2**31) for _ in range(n)]
        prior = rng.choice([None, hashlib.sha256(bytes([rng.randrange(256)])).hexdigest()])
        assert impl.page_hashes(tokens, page_size, prior) == oracle_chain(tokens, page_size, prior)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_hashes_accept_numpy_tokens(impl, page_size):
    tokens = np.arange(7, 7 + 2 * page_size, dtype=np.int64)
    assert impl.page_hashes(tokens, page_size) == oracle_chain(tokens.tolist(), page_size)


@pytest.mark.parametrize("dtype", [">i4", ">i8", "<u2"])
def test_page_hashes_read_tokens_of_any_byte_order_by_value(impl, dtype):
    tokens = np.array([1, 2, 3, 4], dtype=dtype)
    assert impl.page_hashes(tokens, 4) == [HASH_OF_1234]
    assert impl.get_hash_str(tokens) == HASH_OF_1234


def test_page_hashes_ignore_a_partial_last_page(impl):
    assert impl.page_hashes([1, 2, 3, 4, 5], 4) == [HASH_OF_1234]
    assert impl.page_hashes([1, 2, 3], 4) == []
    assert impl.page_hashes([], 1) == []


def test_page_hashes_continue_a_chain(impl):
    a, b = list(range(8)), list(range(100, 112))
    head = impl.page_hashes(a, 4)
    assert impl.page_hashes(a + b, 4) == head + impl.page_hashes(b, 4, head[-1])


def test_negative_token_ids_hash_as_uint32_twos_complement(impl):
    tokens = [-1, -(2**31), 5, 2**31 - 1]
    assert impl.page_hashes(tokens, 2) == oracle_chain(tokens, 2)


def test_page_hashes_refuse_page_size_zero(impl):
    with pytest.raises(ValueError):
        impl.page_hashes([1, 2], 0)


def test_namespace_seed_is_deterministic_and_differs_per_key(impl):
    assert impl.namespace_seed("tenant-a") == impl.namespace_seed("tenant-a")
    seeds = {impl.namespace_seed(k) for k in ("tenant-a", "tenant-b", "", "model=x;tp=2")}
    assert len(seeds) == 4
    assert all(len(s) == 64 and int(s, 16) >= 0 for s in seeds)


def test_namespace_seed_agrees_across_implementations(impl):
    from hiradix.tree import _reference

    for key in ("tenant-a", "", "ünïcode"):
        assert impl.namespace_seed(key) == _reference.namespace_seed(key)

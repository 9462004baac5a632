"""Page keys: SGLang's chain without a namespace, a different chain for every namespace
field, the tree's hashes equal to the storage keys, and tenant isolation through a
backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import hiradix
from hiradix.memory.pools import HostKVPool, MHAShape, MLAShape
from hiradix.storage import KeyNamespace, MemoryStorage, page_byte_order, page_keys, storage_keys

TOKENS = list(range(1, 33))
NS = KeyNamespace(model="llama-3-8b", weight_version="r1", kv_dtype="bfloat16", layout="page_first_direct")


def sglang_chain(tokens: list[int], page_size: int) -> list[str]:
    out, prev = [], None
    for i in range(0, len(tokens) - page_size + 1, page_size):
        prev = hiradix.get_hash_str(tokens[i : i + page_size], prev)
        out.append(prev)
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_no_namespace_is_sglang_chain(page_size: int) -> None:
    keys = page_keys(TOKENS, page_size)
    assert keys == sglang_chain(TOKENS, page_size)
    assert all(len(k) == 64 and k == k.lower() for k in keys)  # full width, never truncated
    assert page_keys([1, 2, 3, 4], 4) == ["cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"]


def test_prior_hash_continues_the_chain() -> None:
    whole = page_keys(TOKENS, 4, NS)
    assert page_keys(TOKENS[8:], 4, NS, prior_hash=whole[1]) == whole[2:]


def test_partial_page_has_no_key() -> None:
    assert page_keys(TOKENS[:7], 4) == page_keys(TOKENS[:4], 4)


CHANGES: dict[str, Any] = {
    "model": "llama-3-70b",
    "weight_version": "r2",
    "kv_dtype": "float8_e4m3fn",
    "layout": "page_first",
    "tp_size": 2,
    "tp_sharded": False,
    "tenant": "acme",
    "cache_salt": "s3cr3t",
    "extra": (("lora", "adapter-7"),),
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_namespace_field_changes_every_key(field: str) -> None:
    other = dataclasses.replace(NS, **{field: CHANGES[field]})
    a, b = page_keys(TOKENS, 4, NS), page_keys(TOKENS, 4, other)
    assert not set(a) & set(b)
    assert NS.extra_key() != other.extra_key()


def test_namespaced_keys_differ_from_unnamespaced_and_are_deterministic() -> None:
    assert not set(page_keys(TOKENS, 4, NS)) & set(page_keys(TOKENS, 4))
    same = KeyNamespace(**dataclasses.asdict(NS))
    assert same.seed() == NS.seed() and page_keys(TOKENS, 4, same) == page_keys(TOKENS, 4, NS)
    # extra pairs are order-insensitive
    x = dataclasses.replace(NS, extra=(("a", "1"), ("b", "2")))
    y = dataclasses.replace(NS, extra=(("b", "2"), ("a", "1")))
    assert x.seed() == y.seed()


def test_tree_hash_values_equal_storage_keys() -> None:
    tree = hiradix.HiRadixTree(page_size=4, enable_hash=True)
    r = tree.insert(TOKENS, np.arange(len(TOKENS)), extra_key=NS.extra_key())
    assert tree.hash_value(r.last_node) == page_keys(TOKENS, 4, NS)
    tree.insert(TOKENS, np.arange(len(TOKENS)))
    m = tree.match_prefix(TOKENS)
    assert tree.hash_value(m.last_node) == page_keys(TOKENS, 4)


def test_tp_rank_suffix() -> None:
    sharded = dataclasses.replace(NS, tp_size=4)
    keys = [page_keys(TOKENS, 16, sharded, tp_rank=r) for r in range(4)]
    assert keys[0][0].endswith("_r0") and keys[3][1].endswith("_r3")
    chain = list(hiradix.page_hashes(TOKENS, 16, sharded.seed()))
    assert all([k[:64] for k in ks] == chain for ks in keys)  # one chain, per-rank suffixes
    assert all(k == h + f"_r{r}" for r, ks in enumerate(keys) for k, h in zip(ks, chain, strict=True))
    replicated = dataclasses.replace(NS, tp_size=4, tp_sharded=False)
    assert page_keys(TOKENS, 16, replicated, tp_rank=2) == page_keys(TOKENS, 16, replicated, tp_rank=0)
    assert page_keys(TOKENS, 16, NS, tp_rank=0) == page_keys(TOKENS, 16, NS)  # tp_size 1: no suffix
    with pytest.raises(ValueError):
        page_keys(TOKENS, 16, sharded, tp_rank=4)
    with pytest.raises(ValueError):
        page_keys(TOKENS, 16, None, tp_rank=1)


def test_for_pool() -> None:
    mha = HostKVPool(MHAShape(2, 2, 4), 16, 4, torch.bfloat16, "layer_first", pin_memory=False, reserve_bytes=0)
    mla = HostKVPool(MLAShape(2, 8, 4), 16, 4, torch.bfloat16, "page_first", pin_memory=False, reserve_bytes=0)
    a = KeyNamespace.for_pool("m", mha, tp_size=2, tenant="t")
    b = KeyNamespace.for_pool("m", mla, tp_size=2, tenant="t")
    assert (a.kv_dtype, a.layout, a.tp_sharded) == ("bfloat16", "page_first_direct", True)
    assert (b.layout, b.tp_sharded) == ("page_first", False)
    assert a.seed() != b.seed()
    assert page_byte_order("page_first_direct") == "page_first_direct"
    with pytest.raises(ValueError):
        page_byte_order("nope")


def test_tenant_b_never_hits_tenant_a() -> None:
    a = dataclasses.replace(NS, tenant="a")
    b = dataclasses.replace(NS, tenant="b")
    store = MemoryStorage()
    ka = page_keys(TOKENS, 4, a)
    assert store.batch_set(ka, [bytes([i]) * 64 for i in range(len(ka))])
    kb = page_keys(TOKENS, 4, b)
    assert store.batch_exists(ka) == len(ka)
    assert store.batch_exists(kb) == 0
    assert store.batch_get(kb) == [None] * len(kb)
    # nor does an un-namespaced server, nor a different cache_salt
    assert store.batch_exists(page_keys(TOKENS, 4)) == 0
    assert store.batch_exists(page_keys(TOKENS, 4, dataclasses.replace(a, cache_salt="x"))) == 0


def test_bad_namespace_and_keys() -> None:
    with pytest.raises(ValueError):
        KeyNamespace(model="")
    with pytest.raises(TypeError):
        KeyNamespace(model="m", tenant=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KeyNamespace(model="m", tp_size=0)
    with pytest.raises(ValueError):
        KeyNamespace(model="m", extra=(("a", "1"), ("a", "2")))
    with pytest.raises(TypeError):
        KeyNamespace(model="m", extra=(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        page_keys(TOKENS, 4, prior_hash="abc")
    with pytest.raises(ValueError):
        storage_keys(["abc"])

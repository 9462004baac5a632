"""One L3 shared by stock SGLang and hiradix (issue 12, parts 1 and 3), end to end on CPU.

Part 1: SGLang 0.5.18's *own* HiRadixCache, loading hiradix's memory, file and peer
backends through its real ``--hicache-storage-backend dynamic`` loader as the README shows,
writes a prefix through to L3, evicts it from L1 and L2, and a fresh SGLang cache (new
pools, new tree, the same L3) prefetches it, loads it back and finds every byte of every
layer of every token.

Part 3: a ``hiradix.sglang`` cache in SGLang-compatible mode (``"l3_format": "sglang"``) and
a stock SGLang cache share one L3 (a file backend's directory, one memory backend, a
2-node peer cluster on loopback TCP, a node each): what one writes the other prefetches and
loads back, bytes equal, both ways, for MHA and MLA, ``layer_first`` and ``page_first``,
with a request ``extra_key`` (SGLang's chain ignores it; hiradix's namespaced one would not).
Stock SGLang 0.5.18 reads a plain request: its prefetch at the tree root files the pages
under the root's (empty) ``extra_key``, so its requests with an ``extra_key`` never get L3
hits there; hiradix readers use the writer's ``extra_key``.

Waits are bounded and on real completion signals: hiradix's prefetch and backup events,
SGLang's ack queues and (wrapped, behaviour unchanged) prefetch I/O; no sleeps.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

from hiradix.peer.node import InProcessCluster
from hiradix.storage import MemoryStorage, page_keys, sglang_key_suffix
from tests.sglang.v18 import env as sglang_env
from tests.sglang.v18.env import SHARED
from tests.sglang.v18.l3_roundtrip import MODEL, PAGE, N, radix_key, read, tokens_of, write

pytestmark = pytest.mark.slow  # every layout x backend round trip through stock SGLang

BACKENDS = ["memory", "file", "peer"]
SHAPES = [(mla, layout) for mla in (False, True) for layout in ("layer_first", "page_first")]
SHAPE_IDS = [f"{'mla' if mla else 'mha'}-{layout}" for mla, layout in SHAPES]


@pytest.fixture
def shared(request: pytest.FixtureRequest) -> Any:
    """The memory backend or peer cluster the caches of one test share (sglang_env.SHARED)."""
    made: list[InProcessCluster] = []

    def make(kind: str) -> None:
        if kind == "memory":
            SHARED["memory"] = MemoryStorage()
        elif kind == "peer":
            cluster = InProcessCluster(2, transport="tcp", pool_size=4 << 20, read_timeout_s=10.0)
            made.append(cluster)
            SHARED["peer"] = cluster

    yield make
    SHARED.clear()
    for cluster in made:
        cluster.close()


def l3_flags(kind: str, impl: str, tmp_path: Path, *, node: int = 0, v1: bool = True) -> dict[str, Any]:
    """``storage`` and ``extra_config`` of :func:`sglang_env.build`: the
    ``--hicache-storage-backend`` and ``--hicache-storage-backend-extra-config`` a node of
    ``impl`` runs with on the shared L3 ``kind`` (the README's flags). One extra config
    key, ``"l3_format": "sglang"``, serves both kinds of node."""
    common: dict[str, Any] = {"prefetch_threshold": PAGE, "l3_format": "sglang"}
    where = {"path": str(tmp_path / "l3")} if kind == "file" else {"shared": kind, "node": node}
    if impl == "hiradix":  # hiradix's own backends: file, or the test's shared instance
        return {"storage": "file" if kind == "file" else "shared", "extra_config": json.dumps({**common, **where})}
    loader = {"backend_name": f"hiradix-{kind}", "module_path": "hiradix.sglang.storage", "class_name": "FileStorage"}
    if kind != "file":  # the wrapper SGLang's loader builds, over the shared instance
        loader.update(module_path="tests.sglang.v18.env", class_name="SharedStorage")
    if v1:
        loader["interface_v1"] = 1
    return {"storage": "dynamic", "extra_config": json.dumps({**common, **loader, **where})}


# ---------------------------------------------------------------------------- part 1
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(("mla", "layout"), SHAPES, ids=SHAPE_IDS)
def test_sglangs_own_cache_round_trips_through_our_backends(
    make_sglang, shared, tmp_path: Path, kind: str, mla: bool, layout: str
) -> None:
    shared(kind)
    writer = make_sglang(
        PAGE,
        layout=layout,
        mla=mla,
        model=MODEL,
        prefetch_policy="wait_complete",
        **l3_flags(kind, "sglang", tmp_path, node=0),
    )
    backend = writer.cache.cache_controller.storage_backend
    assert type(backend).__module__ in ("hiradix.sglang.storage", "tests.sglang.v18.env")
    write(writer, tokens_of(1))
    if kind == "file":
        writer.cache.detach_storage_backend()  # a restart: the directory's lock goes with it
    reader = make_sglang(
        PAGE,
        layout=layout,
        mla=mla,
        model=MODEL,
        prefetch_policy="wait_complete",
        **l3_flags(kind, "sglang", tmp_path, node=1),
    )
    read(reader, tokens_of(1))


def test_sglangs_generic_path_without_interface_v1(make_sglang, shared, tmp_path: Path) -> None:
    """Without ``interface_v1`` SGLang copies pages itself (get_data_page / batch_set,
    get_dummy_flat_data_page / batch_get): the same pages."""
    shared("memory")
    writer = make_sglang(
        PAGE, model=MODEL, prefetch_policy="wait_complete", **l3_flags("memory", "sglang", tmp_path, v1=False)
    )
    write(writer, tokens_of(2))
    reader = make_sglang(
        PAGE, model=MODEL, prefetch_policy="wait_complete", **l3_flags("memory", "sglang", tmp_path, v1=False)
    )
    read(reader, tokens_of(2))


# ---------------------------------------------------------------------------- part 3
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(("mla", "layout"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("writer_impl", ["hiradix", "sglang"])
def test_hiradix_and_stock_sglang_read_each_others_pages(
    make_env, make_sglang, shared, tmp_path: Path, kind: str, mla: bool, layout: str, writer_impl: str
) -> None:
    shared(kind)
    reader_impl = "sglang" if writer_impl == "hiradix" else "hiradix"
    builders = {"hiradix": make_env, "sglang": make_sglang}
    opts = {"layout": layout, "mla": mla, "model": MODEL, "prefetch_policy": "wait_complete"}
    writer = builders[writer_impl](PAGE, **opts, **l3_flags(kind, writer_impl, tmp_path, node=0))
    write(writer, tokens_of(3), extra_key="lora-a")
    if kind == "file":
        writer.cache.detach_storage_backend()
    reader = builders[reader_impl](PAGE, **opts, **l3_flags(kind, reader_impl, tmp_path, node=1))
    read(reader, tokens_of(3), extra_key="lora-a" if reader_impl == "hiradix" else None)


def test_sglang_mode_keys_are_sglangs(make_env, shared, tmp_path: Path) -> None:
    """The keys themselves: SGLang's get_hash_str chain (no extra_key, no model in it) and
    HiCacheFile's suffix, exactly what hiradix.sglang.storage stores under SGLang."""
    shared("memory")
    env = make_env(PAGE, model=MODEL, **l3_flags("memory", "hiradix", tmp_path))
    write(env, tokens_of(4), extra_key="tenant-x")
    from sglang.srt.mem_cache.utils import get_hash_str

    hashes = get_hash_str(tokens_of(4), None, page_size=PAGE)
    assert hashes == page_keys(tokens_of(4), PAGE)
    suffix = sglang_key_suffix(MODEL, tp_rank=0, tp_size=1)
    assert suffix == "_org-model-7b_0_1"
    assert SHARED["memory"].batch_exists([h + suffix for h in hashes]) == N // PAGE


def test_default_keys_are_namespaced_and_miss_sglangs(make_env, make_sglang, shared, tmp_path: Path) -> None:
    """Without ``l3_format`` hiradix.sglang keeps its namespaced keys and hiradix's page
    order: a stock SGLang node finds none of its pages (nor they its), and another model's
    or another tenant's hiradix node misses too, while the same model and tenant hit."""
    shared("memory")
    flags = {"storage": "shared", "extra_config": json.dumps({"prefetch_threshold": PAGE, "shared": "memory"})}
    a = make_env(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags)
    write(a, tokens_of(5), extra_key="tenant-a")
    assert a.cache.token_to_kv_pool_host.page_order == "hiradix"
    stock = make_sglang(PAGE, model=MODEL, prefetch_policy="wait_complete", **l3_flags("memory", "sglang", tmp_path))
    assert stock.cache.query_storage_hit_length(stock.cache.root_node, array("q", tokens_of(5))) == 0
    other_model = make_env(PAGE, model="org/other", prefetch_policy="wait_complete", **flags)
    other_tenant = make_env(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags)
    same = make_env(PAGE, model=MODEL, prefetch_policy="wait_complete", **flags)
    for env, extra_key, hit in ((other_model, "tenant-a", 0), (other_tenant, "tenant-b", 0), (same, "tenant-a", N)):
        root = env.cache.match_prefix(MatchPrefixParams(key=radix_key(tokens_of(5), extra_key))).last_host_node
        assert env.cache.query_storage_hit_length(root, array("q", tokens_of(5))) == hit
    read(same, tokens_of(5), extra_key="tenant-a")


def test_a_runtime_attach_must_keep_the_l3_format(make_env, tmp_path: Path) -> None:
    env = make_env(PAGE, storage="memory", extra_config=json.dumps({"l3_format": "sglang"}))
    ok, msg = env.cache.detach_storage_backend()
    assert ok, msg
    ok, msg = env.cache.attach_storage_backend("memory", json.dumps({"l3_format": "hiradix"}))
    assert not ok and "started with 'sglang'" in msg
    ok, msg = env.cache.attach_storage_backend("memory", json.dumps({"l3_format": "sglang"}))
    assert ok, msg
    with pytest.raises(ValueError, match="l3_format must be one of"):
        sglang_env.build(PAGE, storage="memory", extra_config=json.dumps({"l3_format": "vllm"}))

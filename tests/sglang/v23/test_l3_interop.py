"""Stock SGLang 0.5.23 on hiradix's L3 backends (issue 12, part 1), end to end on CPU.

SGLang 0.5.23 has no HiRadixCache: ``--enable-hierarchical-cache`` builds a
``UnifiedRadixCache`` whose ``HybridCacheController`` loads hiradix's memory, file and peer
backends through ``--hicache-storage-backend dynamic`` (the README's extra config). Each
writes a prefix through to L3, evicts it from L1 and L2, and a fresh cache (new pools,
new tree, the same L3) prefetches it, loads it back and finds every byte of every layer
of every token, for MHA and MLA, ``layer_first`` and ``page_first_direct``, with SGLang's
zero-copy v1 calls and without them (SGLang's generic page copies).

Waits are bounded and on real completion signals (SGLang's ack queues, its prefetch I/O
wrapped with behaviour unchanged); no sleeps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hiradix.peer.node import InProcessCluster
from hiradix.storage import MemoryStorage
from tests.sglang.unified_env import PAGE, SHARED, build, read, tokens_of, write

BACKENDS = ["memory", "file", "peer"]
SHAPES = [(mla, layout) for mla in (False, True) for layout in ("layer_first", "page_first_direct")]
SHAPE_IDS = [f"{'mla' if mla else 'mha'}-{layout}" for mla, layout in SHAPES]


@pytest.fixture
def shared(request: pytest.FixtureRequest) -> Any:
    """The memory backend or peer cluster the caches of one test share (sglang_unified_env.SHARED)."""
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


def l3_flags(kind: str, tmp_path: Path, *, node: int = 0, v1: bool = True) -> dict[str, Any]:
    """``storage`` and ``extra_config`` of :func:`sglang_unified_env.build`: the README's
    ``--hicache-storage-backend dynamic`` and ``--hicache-storage-backend-extra-config``
    for hiradix's backend ``kind`` (memory and peer: the test's shared instance)."""
    config: dict[str, Any] = {"prefetch_threshold": PAGE, "backend_name": f"hiradix-{kind}"}
    if kind == "file":
        config.update(module_path="hiradix.sglang.storage", class_name="FileStorage", path=str(tmp_path / "l3"))
    else:
        config.update(module_path="tests.sglang.unified_env", class_name="SharedStorage", shared=kind, node=node)
    if v1:
        config["interface_v1"] = 1
    return {"storage": "dynamic", "extra_config": json.dumps(config)}


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(("mla", "layout"), SHAPES, ids=SHAPE_IDS)
def test_sglang23s_own_cache_round_trips_through_our_backends(
    sglang_cpu, shared, tmp_path: Path, kind: str, mla: bool, layout: str
) -> None:
    shared(kind)
    writer = build(mla=mla, layout=layout, **l3_flags(kind, tmp_path, node=0))
    backend = writer.cache.cache_controller.storage_backend
    assert type(backend).__module__ in ("hiradix.sglang.storage", "tests.sglang.unified_env")
    assert backend.suffix == ("_org-model-7b" if mla else "_org-model-7b_0_1")
    write(writer, tokens_of(1))
    if kind == "file":
        ok, msg = writer.cache.detach_storage_backend()  # a restart: the directory's lock goes with it
        assert ok, msg
    reader = build(mla=mla, layout=layout, **l3_flags(kind, tmp_path, node=1))
    read(reader, tokens_of(1))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sglang23s_generic_path_without_interface_v1(sglang_cpu, shared, tmp_path: Path, mla: bool) -> None:
    """Without ``interface_v1`` SGLang copies pages itself (get_data_page / batch_set,
    get_dummy_flat_data_page / batch_get): the same pages."""
    shared("memory")
    writer = build(mla=mla, **l3_flags("memory", tmp_path, v1=False))
    write(writer, tokens_of(2))
    reader = build(mla=mla, **l3_flags("memory", tmp_path, v1=False))
    read(reader, tokens_of(2))

"""hiradix's tree core against SGLang 0.5.23's own, in lockstep through ``UnifiedRadixCache``.

One ``UnifiedRadixCache`` per core (SGLang's Python core, its Rust core where the installed
wheel carries it, and hiradix's, ``tree_core_backend="hiradix"`` as
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=hiradix`` selects it), each on its own SGLang CPU
pools, runs the same seeded operations: match, insert (fresh rows, and rows that reuse a
match as the scheduler's ``checkpoint`` does), lock and unlock, evict. After every step the
answers are compared: match results (node ids through a bijection built as ids appear),
the matched device indices, insert results, the cache actions and the eviction frees each
core handed the controller, the sizes, the events, the allocators' free counts, every
cached value and the shape of every known node's root path; then hiradix's full invariant
check and SGLang's ``sanity_check`` run on each core.

This is issue 48's first slice: the FULL component on the device tier.
"""

from __future__ import annotations

import random
import warnings
from array import array
from typing import Any

import pytest
import torch

from tests.sglang import unified_env  # noqa: F401  (skips without SGLang >= 0.5.20, says why)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache import tree_core_registry
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

import hiradix.sglang as hs
from hiradix.sglang.tree_core import TREE_CORE_NAME, HiradixTreeCore
from tests.sglang.pools import sglang_pools

FULL = ComponentType.FULL
SLOTS = 2048  # each cache's KV slots: room for the held rows, pressure for eviction


def _rust_available() -> str | None:
    """Why SGLang's Rust core cannot join (None: it can)."""
    try:
        from sglang.srt.mem_cache.rust_tree_core.extension import bindings  # noqa: F401
    except Exception as e:
        return f"the Rust core does not load: {e}"
    return None


class Run:
    """One ``UnifiedRadixCache`` on one core, with what it handed its controller."""

    def __init__(self, backend: str, page_size: int) -> None:
        self.backend = backend
        _, self.alloc, req_to_token = sglang_pools(page_size, SLOTS, False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=req_to_token,
            token_to_kv_pool_allocator=self.alloc,
            page_size=page_size,
            tree_components=(FULL,),
            tree_core_backend=backend,
        )
        self.cache = UnifiedRadixCache(params)
        self.core = self.cache.tree_core
        self.log: list[Any] = []
        apply_actions = self.cache._apply_cache_actions
        apply_evict = self.cache._apply_eviction_result

        def record_actions(actions: list[Any]) -> None:
            self.log.extend(_action(a) for a in actions)
            apply_actions(actions)

        def record_evict(result: Any) -> None:
            frees = {ct.name: [v.tolist() for v in vs] for ct, vs in result.device_frees.items() if vs}
            hfrees = {ct.name: [v.tolist() for v in vs] for ct, vs in result.host_frees.items() if vs}
            self.log.append(
                (
                    "evict-step",
                    type(result).__name__,
                    frees,
                    hfrees,
                    {ct.name: n for ct, n in result.tracker.items() if n},
                )
            )
            apply_evict(result)

        self.cache._apply_cache_actions = record_actions
        self.cache._apply_eviction_result = record_evict

    def alloc_row(self, n: int) -> torch.Tensor:
        row = self.alloc.alloc(n)
        assert row is not None, f"{self.backend}: no {n} KV slots"
        return row.to(torch.int64)

    def take_log(self) -> list[Any]:
        out, self.log = self.log, []
        return out


def _action(a: Any) -> Any:
    fields = {}
    for name in a.__struct_fields__:
        v = getattr(a, name)
        if isinstance(v, list):
            v = [x.tolist() if isinstance(x, torch.Tensor) else x for x in v]
        elif isinstance(v, torch.Tensor):
            v = v.tolist()
        fields[name] = v
    return (type(a).__name__, fields)


class Ids:
    """The node-id bijection from one core to the reference core: ids are minted by each
    core its own way, but the same node must get the same id every time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.to_ref: dict[int, int] = {}
        self.from_ref: dict[int, int] = {}

    def same(self, mine: Any, ref: Any, what: str) -> None:
        if mine is None or ref is None:
            assert mine is None and ref is None, f"{self.name}: {what}: {mine} vs reference {ref}"
            return
        if mine in self.to_ref or ref in self.from_ref:
            assert self.to_ref.get(mine) == ref and self.from_ref.get(ref) == mine, (
                f"{self.name}: {what}: node {mine} (maps to {self.to_ref.get(mine)}) vs reference node {ref}"
            )
        self.to_ref[mine] = ref
        self.from_ref[ref] = mine


def _check_all(runs: list[Run], ids: list[Ids], step: str) -> None:
    ref = runs[0]
    want = _state(ref)
    ref.core.sanity_check([], [])
    for run, bij in zip(runs[1:], ids[1:], strict=True):
        got = _state(run)
        assert got == want, f"step {step}: {run.backend} differs from {ref.backend}:\n{got}\n{want}"
        mine, theirs = _paths(run, bij, ref)
        assert mine == theirs, f"step {step}: {run.backend}'s node paths differ:\n{mine}\n{theirs}"
        run.core.sanity_check([], [])
        if isinstance(run.core, HiradixTreeCore):
            run.core.check_invariants()


def _state(run: Run) -> dict[str, Any]:
    core = run.core
    return {
        "evictable": core.evictable_size(),
        "protected": core.protected_size(),
        "full": (core.full_evictable_size(), core.full_protected_size()),
        "component": (core.component_evictable_size(FULL), core.component_protected_size(FULL)),
        "total": core.total_size(),
        "values": sorted(core.all_values_flatten().tolist()),
        "free_slots": run.alloc.available_size(),
        "events": core.take_events(),
        "cache_sizes": (run.cache.evictable_size(), run.cache.protected_size()),
    }


def _paths(run: Run, bij: Ids, ref: Run) -> tuple[list[Any], list[Any]]:
    """The root path of every live node both cores named, as (start, end, value length)
    rows read from each core; the nodes on the two paths are paired in the bijection
    (which names the split prefixes no result named yet, and checks the rest)."""
    pairs = [(m, r) for m, r in sorted(bij.to_ref.items()) if _alive(run.core, m) or _alive(ref.core, r)]
    mine = run.core.collect_path_info([m for m, _ in pairs])
    theirs = ref.core.collect_path_info([r for _, r in pairs])
    for path, ref_path in zip(mine, theirs, strict=True):
        for p, q in zip(path, ref_path, strict=False):  # unequal lengths: the rows below differ
            bij.same(p.node_id, q.node_id, "a node on a root path")
            bij.same(p.parent_id, q.parent_id, "a parent on a root path")
    rows = [[(p.path_start, p.path_end, p.full_value_len, p.num_children) for p in path] for path in mine]
    ref_rows = [[(p.path_start, p.path_end, p.full_value_len, p.num_children) for p in path] for path in theirs]
    return rows, ref_rows


def _alive(core: Any, node_id: int) -> bool:
    try:
        core.collect_path_info([node_id])
    except (KeyError, ValueError, RuntimeError, IndexError):
        return False
    return True


def _backends() -> list[str]:
    names = ["python"]
    if _rust_available() is None:
        names.append("rust")
    names.append(TREE_CORE_NAME)
    return names


def _tokens(rng: random.Random, prefixes: list[list[int]], page: int) -> list[int]:
    base = list(rng.choice(prefixes))
    cut = rng.randrange(0, len(base) + 1)
    tail = [rng.randrange(1, 6) for _ in range(rng.randrange(0, 4 * page + 3))]
    return base[:cut] + tail


def _lockstep(seed: int, steps: int, page: int) -> dict[str, int]:
    hs.register()
    runs = [Run(b, page) for b in _backends()]
    assert type(runs[0].core).__name__ == "UnifiedTreeCore"
    for run in runs[1:]:
        want = "RustUnifiedTreeCore" if run.backend == "rust" else "HiradixTreeCore"
        assert type(run.core).__name__ == want, f"{run.backend}: SGLang built {type(run.core).__name__}"
    ids = [Ids(r.backend) for r in runs]
    for bij, run in zip(ids, runs, strict=True):
        bij.same(run.core.root_node_handle(), runs[0].core.root_node_handle(), "root")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 6) for _ in range(rng.randrange(page, 10 * page))] for _ in range(4)]
    held: list[list[tuple[int, Any]]] = []  # per lock: each run's (node id, receipt)
    counts = {"match": 0, "insert": 0, "insert_reuse": 0, "lock": 0, "unlock": 0, "evict": 0, "reset": 0}
    _check_all(runs, ids, "start")
    for step in range(steps):
        op = rng.choices(
            ["match", "insert", "insert_reuse", "lock", "unlock", "evict", "reset"], [4, 4, 3, 2, 2, 2, 0.05]
        )[0]
        counts[op] += 1
        tokens = _tokens(rng, prefixes, page)
        extra = rng.choice([None, None, None, "lora-a"])
        want_tokens = rng.randrange(1, 6 * page + 1)  # drawn once: every core is asked the same
        results = []
        for run in runs:
            key = RadixKey(array("q", tokens), extra_key=extra)
            if op == "match" or op == "lock":
                m = run.cache.match_prefix(MatchPrefixParams(key=key))
                indices = run.core.collect_full_device_indices(m.last_device_node, run.core.root_node_handle())
                r: Any = (m, indices.tolist())
                if op == "lock":
                    receipt = run.cache.inc_lock_ref(m.last_device_node)
                    r = (m, indices.tolist(), receipt.delta)
                results.append(r)
            elif op == "insert":
                n = len(tokens) // page * page
                value = run.alloc_row(n) if n else None
                res = run.cache.insert(InsertParams(key=key, value=value))
                results.append(res)
            elif op == "insert_reuse":
                # as the scheduler checkpoints a request: its matched prefix's slots, then fresh ones
                m = run.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key=extra)))
                prefix = run.core.collect_full_device_indices(m.last_device_node, run.core.root_node_handle())
                n = len(tokens) // page * page
                fresh = run.alloc_row(n - m.device_prefix_len) if n > m.device_prefix_len else None
                value = torch.cat([prefix, fresh]) if fresh is not None else prefix[:n]
                res = run.cache.insert(InsertParams(key=key, value=value, prev_prefix_len=m.device_prefix_len))
                results.append((m, res))
            elif op == "unlock":
                results.append(None)
            elif op == "evict":
                results.append(run.cache.evict(EvictParams(num_tokens=want_tokens)))
            elif op == "reset":
                if held:
                    results.append(None)
                    continue
                run.cache.reset()
                results.append(run.core.root_node_handle())
        if op == "unlock" and held:
            lock = held.pop(rng.randrange(len(held)))
            for run, (node_id, receipt) in zip(runs, lock, strict=True):
                run.cache.dec_lock_ref(
                    node_id,
                    DecLockRefParams(
                        node_id=receipt.node_id,
                        skipped_lock_components=receipt.skipped_lock_components,
                        component_lock_uuids=receipt.component_lock_uuids,
                        component_host_lock_uuids=receipt.component_host_lock_uuids,
                    ),
                )
        if op == "lock":
            held.append([(r[0].last_device_node, run.cache_receipt) for r, run in zip(results, runs, strict=True)])
        _compare(op, step, results, runs, ids)
        if op == "reset" and not held:
            for bij in ids:
                bij.to_ref.clear()
                bij.from_ref.clear()
            for bij, run in zip(ids, runs, strict=True):
                bij.same(run.core.root_node_handle(), runs[0].core.root_node_handle(), "root after reset")
        logs = [run.take_log() for run in runs]
        for run, log in zip(runs[1:], logs[1:], strict=True):
            assert _map_log(log, ids[runs.index(run)]) == logs[0], (
                f"step {step} ({op}): {run.backend}'s cache actions differ:\n{log}\n{logs[0]}"
            )
        _check_all(runs, ids, f"{step} ({op})")
    # every lock released: nothing protected, everything evictable
    for lock in held:
        for run, (node_id, receipt) in zip(runs, lock, strict=True):
            run.cache.dec_lock_ref(
                node_id,
                DecLockRefParams(node_id=receipt.node_id, skipped_lock_components=receipt.skipped_lock_components),
            )
    _check_all(runs, ids, "end")
    for run in runs:
        assert run.core.protected_size() == 0
        run.cache.evict(EvictParams(num_tokens=SLOTS))
        assert run.core.total_size() == (0, 0), f"{run.backend}: {run.core.total_size()} left after evicting all"
        assert run.alloc.available_size() == runs[0].alloc.available_size()
    return counts


def _map_log(log: list[Any], bij: Ids) -> list[Any]:
    out = []
    for entry in log:
        if entry[0] == "UpdatePendingBackupOnNodeSplit":
            fields = dict(entry[1])
            for k in ("old_node_id", "new_node_id", "new_child_node_id"):
                fields[k] = bij.to_ref.get(fields[k], fields[k])
            entry = (entry[0], fields)
        elif entry[0] == "BackupKV":
            entry = (entry[0], {"node_ids": [bij.to_ref.get(n, n) for n in entry[1]["node_ids"]]})
        out.append(entry)
    return out


def _compare(op: str, step: int, results: list[Any], runs: list[Run], ids: list[Ids]) -> None:
    ref = results[0]
    for run, bij, got in zip(runs[1:], ids[1:], results[1:], strict=True):
        where = f"step {step} ({op}), {run.backend}"
        if op in ("match", "lock", "insert_reuse"):
            m, mr = (got[0], ref[0])
            for field in ("last_device_node", "last_host_node", "best_match_node", "last_visited_node_id"):
                bij.same(getattr(m, field), getattr(mr, field), f"{where}: match {field}")
            for field in (
                "device_prefix_len",
                "host_hit_length",
                "full_kv_hit_length",
                "swa_host_hit_length",
                "mamba_host_hit_length",
                "mamba_branching_seqlen",
                "swa_branching_seqlen",
            ):
                assert getattr(m, field) == getattr(mr, field), (
                    f"{where}: match {field} {getattr(m, field)} vs {getattr(mr, field)}"
                )
            if op in ("match", "lock"):
                assert got[1] == ref[1], f"{where}: matched device indices differ"
            if op == "lock":
                assert got[2] == ref[2], f"{where}: lock delta {got[2]} vs {ref[2]}"
            if op == "insert_reuse":
                got, ref_i = got[1], ref[1]
                _same_insert(where, got, ref_i, bij)
        elif op == "insert":
            _same_insert(where, got, ref, bij)
        elif op == "evict":
            assert got == ref, f"{where}: evict result {got} vs {ref}; logs {run.log} vs {runs[0].log}"
        elif op == "reset" and got is not None:
            pass


def _same_insert(where: str, got: Any, ref: Any, bij: Ids) -> None:
    bij.same(got.last_device_node, ref.last_device_node, f"{where}: insert last_device_node")
    for field in (
        "prefix_len",
        "total_len",
        "mamba_exist",
        "swa_branch_inserted",
        "rotation_tail_declined",
        "host_insert_dropped",
        "adopted_ranges",
    ):
        assert getattr(got, field) == getattr(ref, field), (
            f"{where}: insert {field} {getattr(got, field)} vs {getattr(ref, field)}"
        )


@pytest.fixture
def lock_receipts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep each cache's last lock receipt on its run (the lock op reads it back)."""
    original = UnifiedRadixCache.inc_lock_ref

    def inc_lock_ref(self: Any, node_id: int, skip: Any = ()) -> Any:
        receipt = original(self, node_id, skip)
        self._parity_receipt = receipt
        return receipt

    monkeypatch.setattr(UnifiedRadixCache, "inc_lock_ref", inc_lock_ref)
    monkeypatch.setattr(Run, "cache_receipt", property(lambda run: run.cache._parity_receipt), raising=False)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lockstep_against_sglang_cores(sglang_cpu: None, lock_receipts: None, seed: int, page: int) -> None:
    counts = _lockstep(seed, 300, page)
    assert counts["match"] and counts["insert"] and counts["evict"] and counts["lock"]


def test_the_rust_core_joins_where_the_wheel_has_it() -> None:
    why = _rust_available()
    if why is not None:
        pytest.skip(why)
    assert "rust" in _backends()


def _small_cache(**more: Any) -> UnifiedRadixCache:
    """A FULL-only ``UnifiedRadixCache`` at page 4 on 256 CPU slots (``more``: further
    ``CacheInitParams`` fields)."""
    _, alloc, req_to_token = sglang_pools(4, 256, False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=4,
        tree_components=(FULL,),
        **more,
    )
    return UnifiedRadixCache(params)


def test_selected_by_the_environment_variable(sglang_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    hs.register()
    assert tree_core_registry.get_tree_core_factory(TREE_CORE_NAME) is not None
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", TREE_CORE_NAME)
    cache = _small_cache()
    assert isinstance(cache.tree_core, HiradixTreeCore)


def test_a_tree_core_that_fails_to_register_leaves_the_cache_backend_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from hiradix.sglang import plugin

    def broken() -> bool:
        raise ImportError("planted: the tree core's module does not import")

    monkeypatch.setattr(plugin, "register_tree_core", broken)
    with caplog.at_level("WARNING", logger="hiradix.sglang.plugin"):
        plugin.register()
    assert get_radix_cache_factory(plugin.BACKEND_NAME) is plugin.create_cache
    assert "hiradix tree core not registered" in caplog.text and "planted" in caplog.text


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tree_components": (FULL, ComponentType.SWA), "sliding_window_size": 8}, "the SWA component"),
        ({"tree_components": (FULL, ComponentType.MAMBA)}, "the MAMBA component"),
        ({"enable_session_radix_cache": True}, "session radix cache"),
        ({"enable_kv_cache_events": True}, "KV cache events"),
        ({"is_eagle": True}, "EAGLE"),
        ({"eviction_policy": "lfu"}, "eviction policy 'lfu'"),
    ],
)
def test_what_it_does_not_serve_is_refused_by_name(sglang_cpu: None, change: dict[str, Any], named: str) -> None:
    from hiradix.sglang.tree_core import create_tree_core

    _, alloc, req_to_token = sglang_pools(4, 256, False)
    fields: dict[str, Any] = dict(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=alloc,
        page_size=4,
        tree_components=(FULL,),
    )
    fields.update(change)
    with pytest.raises(ValueError, match=named):
        create_tree_core(CacheInitParams(**fields), {})


def test_hicache_is_refused_when_the_host_tier_is_wired(sglang_cpu: None) -> None:
    hs.register()
    cache = _small_cache(tree_core_backend=TREE_CORE_NAME)
    with pytest.raises(NotImplementedError, match="HiCache"):
        cache.tree_core.set_hicache_enabled()

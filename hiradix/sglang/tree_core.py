"""hiradix's tree as SGLang 0.5.23's TreeCore (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=hiradix``).

SGLang 0.5.23's ``UnifiedRadixCache`` builds its tree through a registry
(``tree_core_registry.register_tree_core_backend(name, factory)``) and drives it through
``UnifiedTreeCoreInterface``: methods on integer node ids that decide and return cache
actions, which SGLang's controller carries out. This is the second way into SGLang
(``docs/sglang/index.md``): SGLang keeps its controller, kernels, pools and storage,
hiradix supplies the tree. The plugin (:func:`hiradix.sglang.plugin.register`) registers
:func:`create_tree_core` under :data:`TREE_CORE_NAME`.

:class:`HiradixTreeCore` translates; the decisions are ``hiradix.tree.UnifiedFullTree``'s (compiled,
``hiradix.tree._unified``, or its pure-Python twin :mod:`hiradix.tree.unified` under
``HIRADIX_PUREPYTHON=1``).

What this first slice of issue 48 serves: the FULL component on the device tier (match,
stepped insert, path locks, the step-wise device eviction, sizes, path reads). Anything
else is refused, naming it, never served by another core: at construction (the SWA and
Mamba components, any other component, custom components, the session radix cache,
EAGLE bigram keys, KV cache events, an eviction policy other than ``lru``), when
``UnifiedRadixCache.init_hicache`` wires the host tier (HiCache: ``set_hicache_enabled``),
and per call for the methods that only serve those (:func:`_refuse`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.cache_action import FreeDeviceKV
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
    DecSwaLockOnlyResult,
    DemoteResult,
    DriveHostEvictionResult,
    DropSubtreeNoHostResult,
    EvictDeviceLeafResult,
    EvictDeviceNextNodeResult,
    InsertStepResult,
    NodeId,
    RadixCacheWalkResult,
    TreePathNodeInfo,
    UnifiedTreeCoreInterface,
)

from hiradix.tree import UNIFIED_IMPLEMENTATION, UnifiedFullTree

__all__ = ["TREE_CORE_NAME", "HiradixTreeCore", "create_tree_core"]

logger = logging.getLogger(__name__)

#: The name to give ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` (or
#: ``CacheInitParams.tree_core_backend``).
TREE_CORE_NAME = "hiradix"

FULL = ComponentType.FULL


def _refuse(what: str) -> NoReturn:
    raise NotImplementedError(
        f"hiradix's tree core ({TREE_CORE_NAME}) does not support {what} yet (issue 48 serves the FULL "
        "component on the device tier so far); choose SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust or python"
    )


def unsupported(params: Any) -> list[str]:
    """What in SGLang's ``CacheInitParams`` this core does not serve, one phrase each."""
    out = []
    components = tuple(params.tree_components or ())
    if FULL not in components:
        out.append("a tree without the FULL component")
    for ct in components:
        if ct != FULL:
            out.append(f"the {ct.name} component" + (" (hybrid SWA models)" if ct == ComponentType.SWA else ""))
    if params.component_registry_override:
        out.append("custom tree components (component_registry_override)")
    if params.enable_session_radix_cache:
        out.append("the session radix cache (--enable-session-radix-cache)")
    if params.is_eagle:
        out.append("EAGLE bigram keys (is_eagle)")
    if params.enable_kv_cache_events:
        out.append("KV cache events (--kv-events-config)")
    if params.eviction_policy.lower() != "lru":
        out.append(f"the eviction policy {params.eviction_policy!r} (lru only)")
    return out


def create_tree_core(params: Any, components: dict[ComponentType, Any]) -> HiradixTreeCore:
    """SGLang's ``TreeCoreFactory`` for hiradix: refuses, naming each, what it does not
    serve (:func:`unsupported`)."""
    refused = unsupported(params)
    if refused:
        raise ValueError(
            f"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND={TREE_CORE_NAME} does not support: "
            + "; ".join(refused)
            + " (the rust or python core does)"
        )
    logger.info(
        "hiradix: tree core %r serving SGLang's UnifiedRadixCache (FULL component, device tier, page %d; %s tree)",
        TREE_CORE_NAME,
        params.page_size,
        UNIFIED_IMPLEMENTATION,
    )
    return HiradixTreeCore(params)


class _Events:
    """KV cache events are refused at construction: nothing is ever recorded."""

    enabled = False

    def record_all_cleared(self) -> None:
        pass

    def take(self) -> list[Any]:
        return []


# What the tree keeps it keeps as a copy, as SGLang's cores do: a view would pin (and
# follow) the request's row.
_keep = torch.Tensor.clone
_new_match = MatchResult.__new__  # the NamedTuple's own constructor, positional (the hot path)


def _namespace(key: RadixKey) -> Any:
    # the namespace SGLang's child keys carry (RadixKey.child_key_at)
    if key.cache_salt is not None:
        return (key.extra_key, key.cache_salt)
    return key.extra_key


class HiradixTreeCore(UnifiedTreeCoreInterface):
    """SGLang 0.5.23's ``UnifiedTreeCoreInterface`` over :class:`UnifiedFullTree` (FULL,
    device tier). Build it through :func:`create_tree_core`."""

    supports_rotation_base = False  # UnifiedRadixCache refuses sharded allocators with it
    write_back_duplicate_reclaim_digest = 0

    def __init__(self, params: Any) -> None:
        self.page_size = params.page_size
        self.is_eagle = False
        allocator = params.token_to_kv_pool_allocator
        self.device = torch.device(allocator.device) if allocator is not None else torch.device("cpu")
        self.enable_hicache = False
        self.enable_storage = False
        self.enable_external_cache_linker = False
        self.write_through_threshold = 256
        self.is_write_back = False
        self.has_swa_host_pool = False
        self.is_host_memory_buffer_only = False
        self.kv_events = _Events()
        self.tree = UnifiedFullTree(self.page_size, copy_value=_keep)
        self._insert_step: InsertStepResult | None = None
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._new_empty_match_result()

    def _new_empty_match_result(self) -> None:
        root = self.tree.root
        self._empty_match_result = MatchResult(
            device_prefix_len=0, last_device_node=root, last_host_node=root, best_match_node=root, cache_actions=[]
        )

    # ------------------------------------------------------------------ tree API
    def reset(self) -> None:
        self.tree.reset()  # the new root has a new id, as SGLang's cores mint it
        self._insert_step = None
        self._new_empty_match_result()

    def node_by_id(self, node_id: NodeId) -> Any:
        _refuse("node_by_id (SGLang's Python node objects)")

    @property
    def root_node(self) -> Any:
        _refuse("root_node (SGLang's Python node objects)")

    def is_write_through_compatible(self) -> bool:
        return True  # no host tier: nothing on the host to contradict write-through

    def is_backuped(self, node_id: NodeId) -> bool:
        self.tree.key_len(node_id)  # KeyError for a stale id, as SGLang's cores
        return False

    def is_root(self, node_id: NodeId) -> bool:
        return self.tree.is_root(node_id)

    def get_last_hash_value(self, node_id: NodeId) -> str | None:
        _refuse("page hashes (L3 storage)")

    def get_prefix_hash_values(self, node_id: NodeId) -> list[str]:
        _refuse("page hashes (L3 storage)")

    def get_hash_values(self, node_id: NodeId) -> list[str]:
        _refuse("page hashes (L3 storage)")

    def snapshot_buffer_backup(self, node_id: NodeId, pass_prefix_keys: bool) -> Any:
        _refuse("the buffer-only host memory mode")

    def validate_buffer_backup(self, node_id: NodeId, expected_key_length: int) -> Any:
        _refuse("the buffer-only host memory mode")

    def backfill_missing_hash_values(self) -> int:
        _refuse("page hashes (L3 storage)")

    def root_node_handle(self, extra_key: str | None = None) -> NodeId:
        return self.tree.root  # one root serves every namespace

    def dfs_weight_order(self, node_ids: Sequence[NodeId]) -> list[int]:
        # SGLang's order: input indices grouped by node, depth first, heavier subtrees first
        by_node: dict[int, list[int]] = {}
        for i, nid in enumerate(node_ids):
            self.tree.key_len(nid)
            by_node.setdefault(nid, []).append(i)
        weight: dict[int, int] = {}

        def subtree(nid: int) -> int:
            w = len(by_node.get(nid, ())) + sum(subtree(c) for c in self.tree.children(nid))
            weight[nid] = w
            return w

        subtree(self.tree.root)
        order: list[int] = []

        def visit(nid: int) -> None:  # children first, heaviest first (a stable sort), then the node
            for c in sorted(self.tree.children(nid), key=lambda c: -weight[c]):
                if weight[c]:
                    visit(c)
            order.extend(by_node.get(nid, ()))

        visit(self.tree.root)
        return order

    def collect_path_info(self, end_node_ids: Sequence[NodeId]) -> tuple[tuple[TreePathNodeInfo, ...], ...]:
        return tuple(tuple(TreePathNodeInfo(*row) for row in self.tree.path_info(nid)) for nid in end_node_ids)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node_id: NodeId, skip_lock_components: Sequence[ComponentType] = ()) -> IncLockRefResult:
        skipped = tuple(skip_lock_components)
        result = IncLockRefResult(node_id=node_id, skipped_lock_components=skipped)
        if FULL not in skipped:
            result.delta = self.tree.inc_lock_ref(node_id)
        else:
            self.tree.key_len(node_id)
        return result

    def dec_lock_ref(self, node_id: NodeId, params: DecLockRefParams, skip_swa: bool = False) -> DecLockRefResult:
        assert params.node_id == node_id, f"lock receipt anchored on node {params.node_id} released on node {node_id}"
        if FULL not in params.skipped_lock_components:
            self.tree.dec_lock_ref(node_id)
        return DecLockRefResult()

    def inc_full_pin(self, node_id: NodeId) -> None:
        self.tree.inc_lock_ref(node_id)

    def dec_full_pin(self, node_id: NodeId) -> None:
        self.tree.dec_lock_ref(node_id)

    def dec_swa_lock_only(self, node_id: NodeId, params: DecLockRefParams) -> DecSwaLockOnlyResult:
        # no SWA component: nothing to release early (SGLang's Python core answers the same)
        assert params.node_id == node_id, f"lock receipt anchored on node {params.node_id} released on node {node_id}"
        return DecSwaLockOnlyResult()

    def inc_host_lock_ref(self, node_id: NodeId) -> IncLockRefResult:
        # FULL locks a host copy only where there is one: none without the host tier
        self.tree.key_len(node_id)
        return IncLockRefResult(node_id=node_id)

    def dec_host_lock_ref(self, node_id: NodeId, params: DecLockRefParams) -> DecLockRefResult:
        assert params.node_id == node_id, f"lock receipt anchored on node {params.node_id} released on node {node_id}"
        return DecLockRefResult()

    # ------------------------------------------------------------------ device eviction
    def _full_only(self, component_type: ComponentType) -> None:
        if component_type != FULL:
            _refuse(f"the {component_type.name} component")

    def evict_device_start(self, component_type: ComponentType, request_cnt: int) -> None:
        self._full_only(component_type)
        self.tree.evict_start(request_cnt)

    def evict_device_next_node(
        self, component_type: ComponentType, tracker: dict[ComponentType, int]
    ) -> EvictDeviceNextNodeResult:
        self._full_only(component_type)
        node_id = self.tree.evict_next(tracker.get(FULL, 0))
        return EvictDeviceNextNodeResult(node_id=node_id, made_progress=node_id is not None)

    def evict_device_leaf(self, node_id: NodeId, is_write_back: bool) -> EvictDeviceLeafResult:
        result = EvictDeviceLeafResult()
        freed = self.tree.evict_leaf(node_id)
        tokens = sum(len(v) for v in freed)
        result.device_frees[FULL].extend(freed)
        result.tracker[FULL] += tokens
        result.unbacked_tokens = tokens  # no host copy: every token freed is gone
        return result

    def evict_device_end(self, component_type: ComponentType) -> None:
        self._full_only(component_type)
        self.tree.evict_end()

    def finish_mamba_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        _refuse("the MAMBA component")

    def finish_swa_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        _refuse("the SWA component")

    def drop_subtree_no_host(self, node_id: NodeId) -> DropSubtreeNoHostResult:
        _refuse("HiCache write-back")

    def demote(self, node_id: NodeId) -> DemoteResult:
        _refuse("HiCache (demote to the host tier)")

    def drive_host_eviction(self, component_type: ComponentType, num_tokens: int) -> DriveHostEvictionResult:
        return DriveHostEvictionResult()  # no host tier: nothing to evict

    def evict_excess_path_states(
        self,
        tail_node_id: NodeId,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[Any],
    ) -> None:
        _refuse("the MAMBA component")

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def component_evictable_size(self, component_type: ComponentType) -> int:
        return self.tree.evictable_size() if component_type == FULL else 0

    def component_protected_size(self, component_type: ComponentType) -> int:
        return self.tree.protected_size() if component_type == FULL else 0

    def adjust_component_size(self, node_id: NodeId, component_type: ComponentType, delta: int) -> None:
        _refuse("per-node size adjustments (non-FULL component backings)")

    def full_evictable_size(self) -> int:
        return self.tree.evictable_size()

    def full_protected_size(self) -> int:
        return self.tree.protected_size()

    def swa_evictable_size(self) -> int:
        return 0

    def mamba_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def mamba_protected_size(self) -> int:
        return 0

    def total_size(self) -> tuple[int, int]:
        total = 0
        for nid, _, _ in self.tree.walk():
            v = self.tree.value(nid)
            if v is not None:
                total += len(v)
        return total, 0

    def all_values_flatten(self) -> torch.Tensor:
        values = [v for nid, _, _ in self.tree.walk() if (v := self.tree.value(nid)) is not None]
        return torch.cat(values) if values else torch.tensor([], dtype=torch.int64, device=self.device)

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return torch.tensor([], dtype=torch.int64, device=self.device)

    def walk_for_kv_canary(self, unlocked_only: bool, swa_resident_only: bool) -> RadixCacheWalkResult:
        slots: list[int] = []
        positions: list[int] = []
        prev: list[int] = []
        last_slot: dict[int, int] = {self.tree.root: -1}
        for nid, depth, parent in self.tree.walk():
            v = self.tree.value(nid)
            node_slots = v.tolist() if v is not None else []
            emit = not unlocked_only or self.tree.lock_ref(nid) == 0
            chain = last_slot[parent]
            for j, slot in enumerate(node_slots):
                if emit:
                    slots.append(slot)
                    positions.append(depth + j)
                    prev.append(last_slot[parent] if j == 0 else node_slots[j - 1])
                chain = slot
            last_slot[nid] = chain
        return RadixCacheWalkResult(
            slot_indices=torch.tensor(slots, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            prev_slot_indices=torch.tensor(prev, dtype=torch.int64),
        )

    # ------------------------------------------------------------------ match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if len(key) < self.page_size:
            return self._empty_match_result
        ns = key.extra_key if key.cache_salt is None else (key.extra_key, key.cache_salt)
        hit, node = self.tree.match(key.raw_token_ids(), ns)
        # no host tier: the device anchor is the host anchor and the best match; the walk
        # ends where it matched, so it visited that node (None: the root). A split needs a
        # cache action only with a write-through in flight: none.
        return _new_match(
            MatchResult,
            hit,  # device_prefix_len
            node,  # last_device_node
            node,  # last_host_node
            node,  # best_match_node
            0,  # host_hit_length
            0,  # swa_host_hit_length
            None,  # swa_branching_seqlen
            0,  # mamba_host_hit_length
            None,  # mamba_branching_seqlen
            None,  # cache_protected_len
            hit,  # full_kv_hit_length
            [],  # cache_actions
            None if hit == 0 else node,  # last_visited_node_id
            None,  # full_device_match_len
        )

    def match_full_device_prefix(self, key: RadixKey) -> tuple[int, NodeId, int]:
        return self.tree.match_device_prefix(key.raw_token_ids(), _namespace(key))

    @property
    def empty_match_result(self) -> MatchResult:
        return self._empty_match_result

    def is_full_device_evicted(self, node_id: NodeId) -> bool:
        return self.tree.is_evicted(node_id)

    def collect_full_device_indices(self, from_node_id: NodeId, until_node_id: NodeId) -> torch.Tensor:
        values = self.tree.path_values(from_node_id, until_node_id)
        return torch.cat(values) if values else self._empty

    # ------------------------------------------------------------------ insert
    def begin_insert(self, params: InsertParams) -> InsertStepResult:
        # FULL on the device emits only deferrable actions (duplicate frees), so the
        # stepped insert ends at its first step; the walk is single-flight all the same.
        if self._insert_step is not None:
            raise RuntimeError("concurrent insert walks")
        if params.rotation_base is not None:
            _refuse("logical-page KV sharding (rotation_base)")
        key = params.key
        tokens = key.raw_token_ids()
        value = params.value
        if value is None:
            value = torch.tensor(tokens, dtype=torch.int64)
        prefix_len, last_node, frees, new_leaf = self.tree.insert(
            tokens,
            value,
            _namespace(key),
            priority=params.priority or 0,
            prev_prefix_len=params.prev_prefix_len,
            inserted_len=params.inserted_len,
        )
        n = len(tokens) - len(tokens) % self.page_size
        if n == 0:
            result = InsertResult(prefix_len=0, mamba_exist=True, last_device_node=last_node)
        else:
            result = InsertResult(
                prefix_len=prefix_len,
                last_device_node=last_node,
                adopted_ranges={} if params.track_adopted_ranges else None,
            )
            if params.track_adopted_ranges and new_leaf:
                result.record_adopted_range(FULL, prefix_len, n)
        actions: list[Any] = [FreeDeviceKV([v]) for v in frees]
        return InsertStepResult(actions=actions, result=result)

    def resume_insert(self) -> InsertStepResult:
        raise RuntimeError("no in-flight insert")

    def has_ongoing_insert(self) -> bool:
        return False

    def end_insert(self) -> list[Any]:
        return []

    # ------------------------------------------------------------------ HiCache (refused)
    def set_hicache_enabled(self) -> None:
        _refuse("HiCache (--enable-hierarchical-cache: the host tier)")

    def set_host_memory_buffer_only(self) -> None:
        _refuse("the buffer-only host memory mode")

    def insert_host(self, node_id: NodeId, key: RadixKey, host_value: torch.Tensor, hash_value: list[str]) -> Any:
        _refuse("HiCache (insert_host)")

    def build_backup_spec(self, node_id: NodeId) -> Any:
        _refuse("HiCache (backup)")

    def build_storage_backup_spec(self, node_id: NodeId, pass_prefix_keys: bool) -> Any:
        _refuse("HiCache L3 storage")

    def build_hicache_transfers(self, component_type: ComponentType, node_id: NodeId, phase: Any, **kw: Any) -> Any:
        _refuse("HiCache transfers")

    def build_load_back_spec(self, node_id: NodeId, req: Any = None) -> Any:
        _refuse("HiCache (load back)")

    def prefetch_anchor_info(self, node_id: NodeId) -> tuple[str | None, str | None]:
        _refuse("HiCache L3 prefetch")

    def commit_hicache_transfers(self, node_id: NodeId, phase: Any, comp_xfers: Any, **kw: Any) -> None:
        _refuse("HiCache transfers")

    def commit_backup(self, node_id: NodeId, host_indices: torch.Tensor, comp_xfers: Any) -> None:
        _refuse("HiCache (backup)")

    def commit_load_back(self, node_id: NodeId, device_indices: torch.Tensor, kv_xfer: Any, comp_xfers: Any) -> Any:
        _refuse("HiCache (load back)")

    def finish_load_back(self, anchor_node_id: NodeId) -> None:
        _refuse("HiCache (load back)")

    def build_external_linker_offload_transfers(self, node_id: NodeId) -> Any:
        _refuse("the external cache linker")

    def mark_external_cache_stored_path(self, from_node_id: NodeId, until_node_id: NodeId) -> None:
        _refuse("the external cache linker")

    def mark_external_linker_offload_pending(self, node_id: NodeId) -> None:
        _refuse("the external cache linker")

    def finish_external_linker_offload(self, node_ids: Sequence[NodeId], ack_id: NodeId, success: bool) -> None:
        _refuse("the external cache linker")

    def mark_write_through_pending(self, node_ids: list[NodeId], ack_id: NodeId) -> list[NodeId]:
        _refuse("HiCache write-through")

    def finish_write_through(self, node_ids: list[NodeId], ack_id: int) -> None:
        _refuse("HiCache write-through")

    def swa_tombstone_ranges(
        self, key: RadixKey, start: int, end: int, component_type: ComponentType = ComponentType.SWA
    ) -> list[tuple[int, int]]:
        _refuse("the SWA component")

    def attach_swa_window(
        self,
        key: RadixKey,
        window_start: int,
        window_end: int,
        swa_values: torch.Tensor,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[Any]:
        _refuse("the SWA component")

    def set_component_device_value(self, node_id: NodeId, component_type: ComponentType, value: torch.Tensor) -> None:
        _refuse(f"the {component_type.name} component's values")

    def get_component_device_value(self, node_id: NodeId, component_type: ComponentType) -> torch.Tensor | None:
        self._full_only(component_type)
        return self.tree.value(node_id)

    def component_has_host_value_only(self, node_id: NodeId, component_type: ComponentType) -> bool:
        self.tree.key_len(node_id)
        return False

    # ------------------------------------------------------------------ others
    def sanity_check(
        self, ongoing_write_through: list[tuple[int, NodeId]], ongoing_load_back: list[tuple[int, NodeId]]
    ) -> None:
        self.tree.check_invariants()

    def check_invariants(self) -> None:
        """hiradix's full check of the tree (``AssertionError`` with a dump)."""
        self.tree.check_invariants()

    def pretty_print(self) -> None:
        print(self.tree.dump())

"""The decisions of hiradix's TreeCore for SGLang 0.5.23's ``UnifiedRadixCache``: the FULL
component on the device tier.

SGLang 0.5.23's ``UnifiedRadixCache`` keeps its radix tree behind a pluggable *tree core*
(``UnifiedTreeCoreInterface``, methods on integer node ids): the core decides, and returns
what the cache must do (values to free, nodes to back up); SGLang's controller does it.
:class:`UnifiedFullTree` is that decision logic for the FULL component, device tier only,
with no I/O, no threads, no torch and no SGLang: ``hiradix.sglang.tree_core`` turns
SGLang's parameters into its calls and its answers into SGLang's results and cache actions.

What it decides follows the facts of SGLang's own cores (the Python ``UnifiedTreeCore``
with its ``FullComponent``, and the Rust core), so that a lockstep run through the
unchanged ``UnifiedRadixCache`` gives the same answers, node for node:

- node ids are minted once and never reused; a split mints the *prefix* (the child keeps
  its id);
- a match that ends inside a node splits it at the page boundary; the path's access times
  are stamped deepest-newest (``t, t - 1e-5, ...`` up to the root);
- an insert touches the root and every walked node, frees the duplicate slots of the
  overlapping nodes past ``prev_prefix_len``, adds one leaf for the rest and counts one hit
  per node past ``inserted_len``;
- the device lock is a path lock from the node to the root (an evicted bottom segment is
  locked too, with no size moved); the receipt names its anchor;
- eviction walks a heap of the evictable device leaves by last access time; a parent that
  becomes a leaf joins the heap after its last child went.

Values (device indices) are opaque to the tree: it stores, measures (``len``) and cuts
them (slicing), keeps what it stores through ``copy_value`` and hands them back, so the
adapter keeps them as SGLang's tensors.

This is the pure-Python twin of the compiled ``hiradix.tree._unified`` (the same API and
decisions; ``hiradix.tree.UnifiedFullTree`` is whichever serves, ``HIRADIX_PUREPYTHON=1``
selects this one, and ``tests/tree/test_unified_parity.py`` runs the two in lockstep). The
state is an arena of nodes addressed by id, the hot paths (:meth:`match`, :meth:`insert`,
:meth:`inc_lock_ref` / :meth:`dec_lock_ref`, :meth:`evict_next` / :meth:`evict_leaf`)
touch only that arena, and every answer is plain ints, tuples, lists and the stored values.
Node ids are opaque ints, unique over the tree's life (here a counter; the compiled tree's
carry its arena slot and the slot's generation).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = ["NO_NODE", "UnifiedFullTree"]

NO_NODE = -1  # a node id that names no node
_STAMP_STEP = 0.00001  # each ancestor of a matched node is this much older than its child


class _Node:
    """One node. The compiled form keeps these fields in a struct arena."""

    __slots__ = (
        "id",  # never reused
        "parent",  # the parent node (None: the root)
        "children",  # child key -> node, in insertion order (a split keeps the place)
        "tokens",  # the node's own tokens (a slice of the inserted key)
        "ns",  # the namespace the child keys carry (None, extra_key, (extra_key, salt))
        "value",  # device indices (opaque, len() tokens), None when evicted
        "lock_ref",  # path locks through this node
        "last_access_time",  # the tree's clock at the last touch
        "creation_time",  # the tree's clock when its tokens were first cached
        "hit_count",  # inserts that went through it (one per request)
        "priority",  # the highest insert priority seen
    )

    def __init__(self, node_id: int, last_access_time: float, creation_time: float, priority: int) -> None:
        self.id = node_id
        self.parent: _Node | None = None
        self.children: dict[Hashable, _Node] = {}
        self.tokens: Sequence[int] = ()
        self.ns: Hashable = None
        self.value: Any = None
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.creation_time = creation_time
        self.hit_count = 0
        self.priority = priority


class UnifiedFullTree:
    """The FULL component's radix tree on the device tier (see the module's docstring).

    ``page_size`` tokens make a page; keys are cut down to whole pages. Values support
    ``len`` and slicing; the tree keeps each value it stores (a new leaf's, a split's two
    halves, an evicted node's new one) as ``copy_value(v)`` returns it (default: as given),
    so that a caller's slice does not pin the caller's buffer; the duplicate slots it hands
    back are plain slices. ``clock`` is the tree's own counter, advanced by one at each
    stamp, as SGLang's cores advance theirs.
    """

    def __init__(self, page_size: int, *, copy_value: Callable[[Any], Any] | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._copy_value = copy_value
        self._clock = 0.0
        self._next_id = 0
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop every node; a new root (with a new id). Runtime complexity: ``O(1)``."""
        self._nodes: dict[int, _Node] = {}
        self.root = self._new_node(0).id
        root = self._nodes[self.root]
        root.lock_ref = 1  # the root is never evictable
        root.value = ()
        self._evictable = 0  # device tokens under no lock
        self._protected = 0  # device tokens under a lock
        self._leaves: set[_Node] = set()  # evictable device leaves
        self._walking = False
        # the eviction walk's heap, kept between walks: while _heap_fresh it holds exactly
        # the evictable leaves with their current times (the tree changed only by the walks)
        self._heap: list[tuple[float, int, _Node]] = []
        self._heap_fresh = False
        self._walk_quota = 0
        self._walk_last: _Node | None = None
        self._walk_victim: _Node | None = None  # the last victim until evict_leaf takes it

    def _tick(self) -> float:
        t = self._clock
        self._clock += 1.0
        return t

    def _new_node(self, priority: int) -> _Node:
        last = self._tick()
        node = _Node(self._next_id, last, self._tick(), priority)
        self._next_id += 1
        self._nodes[node.id] = node
        return node

    def _node(self, node_id: int) -> _Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise KeyError(f"node {node_id} is not in the tree") from None

    def _child_key(self, ns: Hashable, tokens: Sequence[int], offset: int) -> Hashable:
        page = self.page_size
        plain = tokens[offset] if page == 1 else tuple(tokens[offset : offset + page])
        return plain if ns is None else (ns, plain)

    def _match_len(self, node_tokens: Sequence[int], tokens: Sequence[int], offset: int) -> int:
        n = min(len(node_tokens), len(tokens) - offset)
        i = 0
        while i < n and node_tokens[i] == tokens[offset + i]:
            i += 1
        return i - i % self.page_size

    def _is_device_leaf(self, node: _Node) -> bool:
        if node.parent is None or node.value is None or node.lock_ref > 0:
            return False
        return all(child.value is None for child in node.children.values())

    def _refresh_leaf(self, node: _Node) -> None:
        if self._is_device_leaf(node):
            self._leaves.add(node)
        else:
            self._leaves.discard(node)

    # ------------------------------------------------------------------ reads
    def is_root(self, node_id: int) -> bool:
        return self._node(node_id).parent is None

    def is_evicted(self, node_id: int) -> bool:
        node = self._node(node_id)
        return node.parent is not None and node.value is None

    def value(self, node_id: int) -> Any:
        return self._node(node_id).value

    def parent(self, node_id: int) -> int:
        parent = self._node(node_id).parent
        return NO_NODE if parent is None else parent.id

    def children(self, node_id: int) -> list[int]:
        return [c.id for c in self._node(node_id).children.values()]

    def key_len(self, node_id: int) -> int:
        return len(self._node(node_id).tokens)

    def lock_ref(self, node_id: int) -> int:
        return self._node(node_id).lock_ref

    def hit_count(self, node_id: int) -> int:
        return self._node(node_id).hit_count

    def last_access_time(self, node_id: int) -> float:
        return self._node(node_id).last_access_time

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def num_nodes(self) -> int:
        return len(self._nodes)

    def path_values(self, from_id: int, until_id: int) -> list[Any]:
        """Device values from ``from_id`` up to (not including) ``until_id``, root first.
        Runtime complexity: ``O(depth)``."""
        until = self._node(until_id)
        node: _Node | None = self._node(from_id)
        out = []
        while node is not until:
            assert node is not None and node.value is not None, "path crosses an evicted node"
            out.append(node.value)
            node = node.parent
        out.reverse()
        return out

    def path_info(self, node_id: int) -> list[tuple[int, int, int, int, int | None, int]]:
        """``(id, parent id, start, end, value length or None, children)`` for each node on
        the root-to-node path, the root left out. Runtime complexity: ``O(depth)``."""
        chain = []
        node = self._node(node_id)
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        out = []
        start = 0
        for n in reversed(chain):
            end = start + len(n.tokens)
            assert n.parent is not None
            out.append((n.id, n.parent.id, start, end, None if n.value is None else len(n.value), len(n.children)))
            start = end
        return out

    def walk(self) -> list[tuple[int, int, int]]:
        """``(id, depth in tokens, parent id)`` for every node but the root, depth first
        in child order (SGLang's order for flattening values)."""
        out: list[tuple[int, int, int]] = []

        def visit(node: _Node, depth: int) -> None:
            for child in node.children.values():
                out.append((child.id, depth, node.id))
                visit(child, depth + len(child.tokens))

        visit(self._nodes[self.root], 0)
        return out

    # ------------------------------------------------------------------ match
    def _keep(self, value: Any) -> Any:
        return value if self._copy_value is None else self._copy_value(value)

    def _aligned(self, tokens: Sequence[int]) -> Sequence[int]:
        n = len(tokens) - len(tokens) % self.page_size
        return tokens if n == len(tokens) else tokens[:n]

    def match(self, tokens: Sequence[int], ns: Hashable = None) -> tuple[int, int]:
        """The longest cached device prefix of ``tokens`` (cut to whole pages) in namespace
        ``ns``: ``(matched tokens, deepest matched node)``. Splits the node where the match
        ends inside it, and stamps the matched path. Runtime complexity: ``O(len(tokens))``."""
        self._heap_fresh = False  # stamps times
        tokens = self._aligned(tokens)
        node = self._nodes[self.root]
        offset = 0
        n = len(tokens)
        while offset < n:
            child = node.children.get(self._child_key(ns, tokens, offset))
            if child is None or child.value is None:  # no host tier yet: an evicted node ends the walk
                break
            plen = self._match_len(child.tokens, tokens, offset)
            offset += plen
            if plen < len(child.tokens):
                node = self._split(child, plen)
                break
            node = child
        stamp = self._tick()
        cur: _Node | None = node
        while cur is not None:
            cur.last_access_time = stamp
            stamp -= _STAMP_STEP
            cur = cur.parent
        return offset, node.id

    def match_device_prefix(self, tokens: Sequence[int], ns: Hashable = None) -> tuple[int, int, int]:
        """Read-only: ``(matched tokens, deepest node, tokens of the nodes it pins)``."""
        tokens = self._aligned(tokens)
        node = self._nodes[self.root]
        offset = matched = pinned = 0
        while offset < len(tokens):
            child = node.children.get(self._child_key(ns, tokens, offset))
            if child is None or child.value is None:
                break
            plen = self._match_len(child.tokens, tokens, offset)
            if plen == 0:
                break
            matched += plen
            node = child
            pinned += len(child.tokens)
            if plen < len(child.tokens):
                break
            offset += plen
        return matched, node.id, pinned

    def _split(self, child: _Node, split_len: int) -> _Node:
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.tokens)
        new = self._new_node(child.priority)
        ck = self._child_key(child.ns, child.tokens, 0)
        new.parent = parent
        new.ns = child.ns
        new.tokens, child.tokens = child.tokens[:split_len], child.tokens[split_len:]
        new.hit_count = child.hit_count
        new.creation_time = child.creation_time
        new.lock_ref = child.lock_ref
        if child.value is not None:
            new.value, child.value = self._keep(child.value[:split_len]), self._keep(child.value[split_len:])
        new.children = {self._child_key(child.ns, child.tokens, 0): child}
        child.parent = new
        parent.children[ck] = new  # the same key: the prefix takes the child's place
        child.last_access_time = self._tick()
        self._refresh_leaf(new)
        self._refresh_leaf(child)
        return new

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        tokens: Sequence[int],
        value: Any,
        ns: Hashable = None,
        *,
        priority: int = 0,
        prev_prefix_len: int = 0,
        inserted_len: int = 0,
    ) -> tuple[int, int, list[Any], bool]:
        """Cache ``tokens`` (cut to whole pages) with their device ``value`` (at least as
        long): ``(prefix_len, last node, frees, new_leaf)``. The overlap with what is cached
        past ``prev_prefix_len`` comes back in ``frees`` (slices of ``value``: the caller's
        duplicate slots); the rest becomes one new leaf. Nodes past ``inserted_len`` count a
        hit. Runtime complexity: ``O(len(tokens))``."""
        self._heap_fresh = False
        tokens = self._aligned(tokens)
        root = self._nodes[self.root]
        root.last_access_time = self._tick()
        root.priority = max(root.priority, priority)
        frees: list[Any] = []
        if len(tokens) == 0:
            return 0, root.id, frees, False
        node = root
        offset = 0
        n = len(tokens)
        while offset < n:
            child = node.children.get(self._child_key(ns, tokens, offset))
            if child is None:
                break
            child.last_access_time = self._tick()
            plen = self._match_len(child.tokens, tokens, offset)
            if plen < len(child.tokens):
                child = self._split(child, plen)
            child.priority = max(child.priority, priority)
            if child.value is None:
                self._unevict(child, self._keep(value[offset : offset + plen]))
            else:
                dup_start = max(0, prev_prefix_len - offset)
                if dup_start < plen:
                    frees.append(value[offset + dup_start : offset + plen])
            if offset + plen > inserted_len:
                child.hit_count += 1
            node = child
            offset += plen
        if offset == n:
            return offset, node.id, frees, False
        leaf = self._new_node(priority)
        leaf.parent = node
        leaf.ns = ns
        leaf.tokens = tokens[offset:]
        leaf.value = self._keep(value[offset:n] if offset or len(value) != n else value)
        node.children[self._child_key(ns, tokens, offset)] = leaf
        self._evictable += n - offset
        self._refresh_leaf(leaf)
        self._refresh_leaf(node)
        if n > inserted_len:
            leaf.hit_count += 1
        return offset, leaf.id, frees, True

    def _unevict(self, node: _Node, value: Any) -> None:
        node.value = value
        if node.lock_ref > 0:
            self._protected += len(value)
        else:
            self._evictable += len(value)
        self._refresh_leaf(node)
        if node.parent is not None:
            self._refresh_leaf(node.parent)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node_id: int) -> int:
        """Lock the path from ``node_id`` to the root; the tokens moved from evictable to
        protected. Runtime complexity: ``O(depth)``."""
        self._heap_fresh = False
        node: _Node | None = self._node(node_id)
        assert node is not None
        anchor = node
        while node.parent is not None and node.value is None:
            node.lock_ref += 1
            node = node.parent
        delta = 0
        while node.parent is not None:
            assert node.value is not None, f"evicted ancestor {node.id} above the device-on segment"
            if node.lock_ref == 0:
                n = len(node.value)
                self._evictable -= n
                self._protected += n
                delta += n
            node.lock_ref += 1
            self._leaves.discard(node)
            node = node.parent
        self._refresh_leaf(anchor)
        return delta

    def dec_lock_ref(self, node_id: int) -> None:
        """Release a lock :meth:`inc_lock_ref` took on ``node_id``.
        Runtime complexity: ``O(depth)``."""
        self._heap_fresh = False
        anchor = node = self._node(node_id)
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise AssertionError(f"FULL segment release hit lock_ref=0 on node {node.id}")
            if node.lock_ref == 1 and node.value is not None:
                n = len(node.value)
                self._evictable += n
                self._protected -= n
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._refresh_leaf(node)
            node = node.parent
        self._refresh_leaf(anchor)

    # ------------------------------------------------------------------ eviction
    def _heap_settle(self) -> None:
        # the walk's pending moves: the last victim's parent, if that made it a leaf, joins
        # the heap; a victim evict_leaf did not take leaves the heap stale
        if self._walk_victim is not None:
            self._heap_fresh = False
            self._walk_victim = None
        last = self._walk_last
        if last is not None and last.parent is not None and last.parent in self._leaves:
            p = last.parent
            heapq.heappush(self._heap, (p.last_access_time, p.id, p))
        self._walk_last = None

    def evict_start(self, quota: int) -> None:
        """Begin an eviction walk that stops once ``quota`` tokens were freed. The heap
        of the last walk is kept and reused when the tree did not change since but by
        that walk's own evictions (it then holds exactly the evictable leaves).
        Runtime complexity: ``O(leaves)``, ``O(1)`` when reused."""
        if self._walking:
            raise AssertionError("FULL device eviction already in progress")
        if not self._heap_fresh:
            self._heap = [(n.last_access_time, n.id, n) for n in self._leaves]
            heapq.heapify(self._heap)
            self._heap_fresh = True
        self._walking = True
        self._walk_quota = quota
        self._walk_last = None
        self._walk_victim = None

    def evict_next(self, freed: int) -> int | None:
        """The next victim (a device leaf), or ``None`` when ``freed`` reached the quota
        or no leaf is left. Runtime complexity: ``O(log leaves)`` per victim."""
        if not self._walking:
            raise AssertionError("FULL device eviction not started")
        self._heap_settle()
        heap = self._heap
        while freed < self._walk_quota and heap:
            node = heapq.heappop(heap)[2]
            if node in self._leaves:
                self._walk_last = self._walk_victim = node
                return node.id
        return None

    def evict_end(self) -> None:
        if not self._walking:
            raise AssertionError("FULL device eviction not started")
        self._heap_settle()  # the heap stays for the next walk
        self._walking = False

    def evict_leaf(self, node_id: int) -> list[Any]:
        """Delete device leaf ``node_id`` (it has no host copy) and the ancestors it
        leaves childless with nothing cached; returns the device values to free.
        Runtime complexity: ``O(1)`` plus the ancestors deleted."""
        node = self._node(node_id)
        if node not in self._leaves:
            raise AssertionError(f"node {node_id} is not an evictable device leaf")
        # the kept heap stays exact only when this is the walk's victim and no ancestor goes
        fresh = self._heap_fresh and self._walking and node is self._walk_victim
        if node is self._walk_victim:
            self._walk_victim = None
        freed = [node.value]
        self._evictable -= len(node.value)
        self._leaves.discard(node)
        self._remove(node)
        cur = node.parent
        assert cur is not None
        self._refresh_leaf(cur)
        while cur.parent is not None and not cur.children and cur.lock_ref == 0:
            if cur.value is not None:
                self._refresh_leaf(cur)
                break
            # neither device nor host: nothing holds it
            parent = cur.parent
            self._remove(cur)
            self._refresh_leaf(parent)
            cur = parent
            fresh = False
        self._heap_fresh = fresh
        return freed

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        removed = parent.children.pop(self._child_key(node.ns, node.tokens, 0), None)
        assert removed is node
        del self._nodes[node.id]

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Parent/child links, page alignment, ``lock_ref >= 0``, the evictable and
        protected sizes and the leaf set against a full recount. ``AssertionError``
        (with the tree's dump) on the first violation. Runtime complexity: ``O(n)``."""
        try:
            self._check()
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.dump()}") from None

    def _check(self) -> None:
        root = self._nodes[self.root]
        assert root.parent is None and root.lock_ref == 1, "root"
        evictable = protected = 0
        seen = 0
        stack = [root]
        while stack:
            node = stack.pop()
            seen += 1
            assert self._nodes.get(node.id) is node, f"node {node.id} not in the arena"
            for ck, child in node.children.items():
                assert child.parent is node, f"node {child.id}: parent link"
                assert ck == self._child_key(child.ns, child.tokens, 0), f"node {child.id}: child key"
                stack.append(child)
            if node is root:
                continue
            assert len(node.tokens) > 0 and len(node.tokens) % self.page_size == 0, f"node {node.id}: not whole pages"
            assert node.lock_ref >= 0, f"node {node.id}: lock_ref {node.lock_ref}"
            parent = node.parent
            assert parent is not None, f"node {node.id}: no parent"
            assert parent is root or parent.lock_ref >= node.lock_ref, f"node {node.id}: locked more than its parent"
            if node.value is not None:
                assert len(node.value) == len(node.tokens), f"node {node.id}: value length"
                if node.lock_ref > 0:
                    protected += len(node.value)
                else:
                    evictable += len(node.value)
            else:
                assert node.children, f"node {node.id}: an evicted leaf with no host copy"
            assert (node in self._leaves) == self._is_device_leaf(node), f"node {node.id}: leaf set"
        assert seen == len(self._nodes), f"{len(self._nodes) - seen} nodes in the arena are not in the tree"
        assert evictable == self._evictable, f"evictable {self._evictable}, recount {evictable}"
        assert protected == self._protected, f"protected {self._protected}, recount {protected}"
        if self._heap_fresh and not self._walking:
            kept = sorted((t, i) for t, i, _ in self._heap)
            assert kept == sorted((n.last_access_time, n.id) for n in self._leaves), "kept eviction heap is stale"

    def dump(self) -> str:
        """The tree, one node a line (id, tokens, value length, lock_ref, time)."""
        lines = []

        def visit(node: _Node, depth: int) -> None:
            for child in node.children.values():
                vlen = None if child.value is None else len(child.value)
                lines.append(
                    f"{'  ' * depth}#{child.id} tokens={list(child.tokens)[:8]}.. len={len(child.tokens)} "
                    f"value={vlen} lock_ref={child.lock_ref} t={child.last_access_time}"
                )
                visit(child, depth + 1)

        visit(self._nodes[self.root], 0)
        return "\n".join(lines) or "(empty)"

"""One-pass capacity curves: the hit rate at every capacity of every tier from one pass.

:meth:`CapacityCurve.from_requests` reads a workload once and gives the LRU hit rate of
the tree at *every* capacity, from LRU stack positions over pages, instead of one
replay per capacity (a full replay of the conversation trace takes about a minute; the
pass takes seconds). :func:`recommend` turns a curve, a target hit rate and prices per
GiB into the cheapest (device, host, L3) sizes; ``hiradix plan`` prints both.

Pages and requests
------------------
A page is ``page_size`` tokens, as in the tree. A request's prompt is cut to whole pages
(the tree caches whole pages only). Page ``j`` of a prompt is identified by the trace
block holding its last token, *as a prefix chain* (the block's id together with the ids
of every block before it), and by that token's offset in the block. Two prompts share
page ``j`` exactly when their first ``(j + 1) * page_size`` tokens agree (token ids are
``block * 512 + offset``, :mod:`hiradix.sim.trace`): that is the tree's own notion of a
shared page, whatever the page size, and it also holds for a block cut short at the end
of a prompt, whose pages are the first pages of the full block.

The model
---------
Requests are served one at a time. At its arrival a request hits the pages of the
longest cached prefix of its prompt; afterwards its whole prompt is cached and every
page of it was touched by the request, the shallower pages *after* the deeper ones
(SGLang's and hiradix's trees stamp the whole matched path at once, and only leaves are
evicted, so the deepest page of a request always goes first among its pages). So the
pass sees one access sequence: request by request, each prompt's pages from the last to
the first. A cache of ``C`` pages that keeps the ``C`` most recently used pages holds,
at a request's arrival, exactly the pages whose *stack position* (1 + the number of
distinct pages used more recently) is at most ``C``; the pass computes that position
for every page of every request at the request's arrival, once, and the hit count at
every ``C`` is a cumulative histogram of the positions.

Why this is the tree's hit, not just LRU's:

* *Prefix closure.* Every request that uses a page also uses its parent page (the
  page before it in the prompt), and uses the parent later in the sequence. So a
  parent is always more recent than its child and has a smaller stack position: the
  pages cached at any capacity form a prefix-closed set (a subtree of the radix tree),
  the positions along a prompt increase strictly, and the pages with position ``<= C``
  are exactly the longest cached prefix, which is what ``match_prefix`` returns. A
  page whose parent was evicted can never be cached, as in the tree.
* *Leaf-first eviction.* The least recent page of an LRU cache is then always a leaf
  of the cached subtree, so evicting it is what the tree's LRU does: the tree evicts
  the unlocked leaf with the oldest access time, and only the current request is
  locked, which the model keeps anyway (it is the most recent).
* *Tiers.* With ``write_through`` every page the device caches is copied to the host
  and a device eviction keeps the host copy; the host evicts only host-only leaves,
  oldest first. So while the host is at least as large as the device, the device holds
  the ``D`` most recent pages and the host the ``H`` most recent (an *inclusive* LRU
  hierarchy), the device hit rate is the curve at ``D`` and the host adds the curve's
  rise from ``D`` to ``H``. An L3 tier of ``L >= H`` tokens is modelled the same way:
  it adds the rise from ``H`` to ``L``. Tier sizes are therefore each tier's own
  capacity, each holding the tiers above it, not slices of one cache.

Where it is exact and where it is not
--------------------------------------
Exact, to the token, under :class:`~hiradix.sim.replay.Replayer`'s defaults with
``eviction_policy="lru"`` and no L3, if the tree evicted page by page. Where the real
cache differs (measured in ``tests/sim/test_curve.py`` and ``bench/RESULTS_capacity.md``):

* *Node-granular eviction.* The tree evicts whole leaf nodes (a node is a run of pages
  shared by the same requests), so it may free more than it needs and hold a little
  less than its capacity: the curve is an upper bound, off by about one node's tokens
  of capacity. On the conversation trace at page 16 it is within 0.3 points of full
  replays at 0.5M to 32M tokens (``bench/RESULTS_capacity.md``).
* *A request larger than the device* is not inserted by the cache at all; the model
  keeps its first pages. Only capacities below the longest prompt (126k tokens on the
  conversation trace) are affected; :func:`recommend` never goes below it.
* *Other eviction policies* (LFU, SLRU, SIEVE, ...) have no stack property: the
  curve is LRU's only.
* *A host smaller than the device* is not inclusive: backups fail once the host is
  full of device copies, and what the host then holds is not the most recent pages.
  The curve gives such a host no hits; the cache may get a few.
* *Other write policies.* ``write_through_selective`` copies a page to the host only
  on its second use, ``write_back`` only on eviction (and may drop it when the host
  has no room): host hits then differ from the inclusive model.
* *L3* is approximate: L3 pages are written from the host and read back only on a
  host miss, so their recency in L3 is not the pages' recency (a page hot on the
  device is not refreshed in L3), L3 evicts pages not prefixes, and the replayer
  prefetches from L3 only when a request misses at least ``prefetch_threshold``
  tokens. The curve shows what an L3 with the same recency could give.
* *Locks and in-flight copies.* Serving one request at a time, nothing but the current
  request is ever locked and the replayer's copies complete inline. A server with many
  requests in flight pins their prefixes and copies asynchronously; the model has
  neither, so it is optimistic for a busy server's small device.
* *Hit-rate definitions* follow :mod:`hiradix.sim.replay`: token rates over page-aligned
  prompt tokens, block rates over all 512-token trace blocks (a block is hit when every
  prompt token of it was hit). Capacities are in tokens and are used as whole pages.

Cost: ``O(N log N)`` time and ``O(N)`` memory for ``N`` page accesses (9.0M on the
conversation trace at page 16), from a Fenwick tree over access times, updated and
queried one request at a time with numpy.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hiradix.sim.extras import figure, progress_bar
from hiradix.sim.timing import TimingModel
from hiradix.sim.trace import BLOCK_TOKENS, TraceRequest

GIB = 1 << 30

TIERS = ("device", "host", "l3")
"""Tier names, top (fastest) first."""


# ---------------------------------------------------------------------------- stack positions
class _Fenwick:
    """Counts of int values in ``0 .. size - 1``: batch insert and batch "how many are
    below" queries, each ``O(k log size)`` numpy work for ``k`` values."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = np.zeros(size + 1, dtype=np.int64)
        self.levels = max(1, int(size).bit_length())

    def add(self, values: np.ndarray) -> None:
        # Every index a value's update walks through, for all values at once; one add.at
        # (indices repeat across values and levels).
        i = values + 1
        steps = []
        for _ in range(self.levels):
            i = i[i <= self.size]
            if not len(i):
                break
            steps.append(i)
            i = i + (i & -i)
        np.add.at(self.tree, np.concatenate(steps), 1)

    def below(self, values: np.ndarray) -> np.ndarray:
        """How many inserted values are ``< values[k]``, for each ``k``."""
        out = np.zeros(len(values), dtype=np.int64)
        i = values.copy()
        for _ in range(self.levels):
            out += self.tree[i]  # tree[0] is 0: finished walks add nothing
            i &= i - 1
            if not i.any():
                break
        return out


def stack_positions(keys: np.ndarray, lengths: np.ndarray, progress: Callable[[int], Any] | None = None) -> np.ndarray:
    """LRU stack position of every page of every request at the request's arrival.

    ``keys`` are the page ids of all requests, one request after the other, each in
    *access order* (the order the pages are touched: for a prompt, the last page first,
    see the module docstring); ``lengths`` the number of pages of each request. Returns,
    for each entry of ``keys``, 1 + the number of distinct pages used more recently than
    it before its request began, or 0 for a page never used before. An LRU cache of
    ``C`` pages holds the page at its request's arrival iff ``0 < position <= C``.
    A page repeated within one request gets its position at the request's arrival both
    times. ``progress(n)``, if given, is called after each request with its page count.

    Runtime complexity: ``O(N log N)`` for ``N = len(keys)`` (a stable sort, then one
    Fenwick insert and query per request); memory ``O(N)``.

    >>> stack_positions(np.array([2, 1, 3, 1, 2, 1]), np.array([2, 1, 3])).tolist()
    [0, 0, 0, 2, 3, 2]
    """
    keys = np.asarray(keys, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if keys.ndim != 1 or lengths.ndim != 1:
        raise ValueError("keys and lengths must be one-dimensional")
    if (lengths < 0).any() or int(lengths.sum()) != len(keys):
        raise ValueError(f"lengths must be >= 0 and sum to len(keys) = {len(keys)}, got sum {int(lengths.sum())}")
    n = len(keys)
    # prev[a]: the access before ``a`` of the same page (-1: none). A stable sort keeps the
    # accesses of one page in sequence order.
    order = np.argsort(keys, kind="stable")
    prev = np.full(n, -1, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    # At a request starting at sequence index s, the page last used at j < s has position
    # #{k in [j, s): next use of k is not before s}
    #   = (s - j) - #{m < s: j <= prev[m]}       (m = the next use of such a k)
    # and the last count is (uses before s with a previous use) - #{m < s: prev[m] < j},
    # which the Fenwick tree over prev values answers.
    out = np.zeros(n, dtype=np.int64)
    fenwick = _Fenwick(max(n, 1))
    inserted = 0
    start = 0
    for length in lengths.tolist():
        end = start + length
        if length:
            p = prev[start:end]
            seen = p >= 0
            q = p[seen]
            if len(q):
                # A page repeated in this request: its second access's prev lies inside
                # the request; use the first access's position instead (fixed below).
                outside = q < start
                qo = q[outside]
                pos = np.zeros(len(q), dtype=np.int64)
                pos[outside] = (start - qo) - (inserted - fenwick.below(qo))
                out[start:end][seen] = pos
                if not outside.all():
                    _repeat_fixup(out, p, start, end)
                fenwick.add(q)
                inserted += len(q)
        start = end
        if progress is not None:
            progress(length)
    return out


def _repeat_fixup(out: np.ndarray, prev: np.ndarray, start: int, end: int) -> None:
    """Give a page used twice in one request the position of its first use there.
    ``O(pages of the request)``, only for requests that repeat a page."""
    seg = out[start:end]
    for k, p in enumerate(prev.tolist()):
        if p >= start:
            seg[k] = seg[p - start]


# ---------------------------------------------------------------------------- pages of a trace
@dataclass(frozen=True)
class _Pages:
    """The page accesses of a workload, in access order (see :func:`stack_positions`)."""

    keys: np.ndarray  # page ids, per request from the last page to the first
    pages: np.ndarray  # prompt pages per request
    blocks: np.ndarray  # trace blocks per request (all of them, the denominator of block rates)
    input_tokens: int
    inputs: np.ndarray  # input tokens per request (page-aligned or not), for TTFT


def _read_pages(
    requests: Iterable[TraceRequest], page_size: int, progress: Callable[[int], Any] | None = None
) -> _Pages:
    """Page ids of every request (module docstring, "Pages and requests").

    Blocks get dense ids per prefix chain: ``(id of the previous block's chain, block)``,
    so that two blocks are the same only with the same blocks before them, as for the
    tree's tokens, whatever the trace's ids promise. ``O(blocks)`` dict work plus
    ``O(pages)`` numpy work.
    """
    chain: dict[tuple[int, int], int] = {}
    chains: list[int] = []  # chain id of every block of every request, flat
    input_lengths: list[int] = []
    blocks: list[int] = []
    for request in requests:
        parent = -1
        for block in request.hash_ids:
            parent = chain.setdefault((parent, block), len(chain))
            chains.append(parent)
        input_lengths.append(request.input_length)
        blocks.append(len(request.hash_ids))
        if progress is not None:
            progress(1)
    block_ids = np.asarray(chains, dtype=np.int64)
    lengths = np.asarray(input_lengths, dtype=np.int64)
    nblocks = np.asarray(blocks, dtype=np.int64)
    pages = lengths // page_size
    total = int(pages.sum())
    owner = np.repeat(np.arange(len(pages)), pages)
    first = np.cumsum(pages) - pages
    # Within a request, access order is the last page first: j runs down.
    j = np.repeat(pages - 1, pages) - (np.arange(total) - np.repeat(first, pages))
    last_token = (j + 1) * page_size - 1
    block_first = np.cumsum(nblocks) - nblocks
    page_block = block_ids[block_first[owner] + last_token // BLOCK_TOKENS] if total else block_ids[:0]
    keys = page_block * BLOCK_TOKENS + last_token % BLOCK_TOKENS
    return _Pages(keys, pages, nblocks, int(lengths.sum()), lengths)


# ---------------------------------------------------------------------------- the curve
def _cumulative(positions: np.ndarray, length: int) -> np.ndarray:
    """``c[C]`` = how many positions are in ``1 .. C``, for ``C`` in ``0 .. length - 1``."""
    counts = np.bincount(positions[positions > 0], minlength=length)[:length]
    counts[0] = 0
    return np.cumsum(counts)


@dataclass(frozen=True)
class CapacityCurve:
    """LRU hit rates of the tree at every capacity, for one workload and page size.

    Build it with :meth:`from_requests`. ``token_hits[C]`` is the number of prompt tokens
    hit with a cache of ``C`` pages (``C`` from 0 to :attr:`max_pages`, beyond which
    nothing changes), ``block_hits[C]`` the number of 512-token blocks hit; the
    denominators are :attr:`prompt_tokens` and :attr:`blocks` (as in
    :class:`~hiradix.sim.replay.ReplayStats`). Capacities passed to the methods are in
    tokens and are cut to whole pages.
    """

    page_size: int
    requests: int
    input_tokens: int
    prompt_tokens: int
    blocks: int
    token_hits: np.ndarray
    block_hits: np.ndarray
    max_prompt_tokens: int  # the longest page-aligned prompt: below it a request may not fit
    # Per request, for TTFT (request_hit_tokens): every page's stack position in access
    # order, the pages and the input tokens of each request. Not part of the summary.
    positions: np.ndarray | None = field(default=None, repr=False, compare=False)
    request_pages: np.ndarray | None = field(default=None, repr=False, compare=False)
    request_inputs: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_requests(
        cls,
        requests: Iterable[TraceRequest],
        *,
        page_size: int = 16,
        progress: bool | None = False,
        total: int | None = None,
    ) -> CapacityCurve:
        """One pass over ``requests`` (any :class:`~hiradix.sim.trace.TraceRequest`
        source: a :class:`~hiradix.sim.trace.MooncakeTrace`, a workload).

        ``progress``: ``True`` shows progress bars on stderr (reading, then the stack
        pass), ``None`` only when stderr is a terminal, ``False`` never; ``total`` is the
        expected number of requests, for the first bar. :class:`ValueError` for a
        page size below 1 or a workload with no prompt page at all; errors of the
        source (:class:`~hiradix.sim.trace.TraceError`, ``OSError``) propagate.

        Runtime complexity: ``O(N log N)`` for ``N`` prompt pages, plus reading.
        """
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        disable = None if progress is None else not progress
        # mininterval: a bar piped to a log file updates every few seconds, not per request.
        bar = {"file": sys.stderr, "disable": disable, "mininterval": 0.5 if sys.stderr.isatty() else 5.0}
        with progress_bar(total=total, unit="req", desc="read", **bar) as read:
            pages = _read_pages(requests, page_size, read.update)
        if not len(pages.pages):
            raise ValueError("the workload has no requests")
        if not pages.pages.any():
            raise ValueError(f"no request has a whole page of {page_size} tokens: nothing can be cached")
        with progress_bar(total=len(pages.keys), unit="page", unit_scale=True, desc="stack pass", **bar) as passed:
            positions = stack_positions(pages.keys, pages.pages, passed.update)
        # Token hits: every page is page_size tokens.
        length = int(positions.max()) + 1
        token_hits = _cumulative(positions, length) * page_size
        # Block hits: block b of a request (with a prompt token) is hit iff the page
        # holding its last prompt token is; that page sits at index last-j in access order.
        prompt = pages.pages * page_size
        held = -(-prompt // BLOCK_TOKENS)  # blocks with at least one prompt token
        request = np.repeat(np.arange(len(held)), held)
        first_block = np.cumsum(held) - held
        b = np.arange(int(held.sum())) - np.repeat(first_block, held)
        last_token = np.minimum((b + 1) * BLOCK_TOKENS, prompt[request]) - 1
        first_page = np.cumsum(pages.pages) - pages.pages
        at = first_page[request] + pages.pages[request] - 1 - last_token // page_size
        block_hits = _cumulative(positions[at], length)
        return cls(
            page_size=page_size,
            requests=len(pages.pages),
            input_tokens=pages.input_tokens,
            prompt_tokens=int(prompt.sum()),
            blocks=int(pages.blocks.sum()),
            token_hits=token_hits,
            block_hits=block_hits,
            max_prompt_tokens=int(prompt.max()),
            positions=positions,
            request_pages=pages.pages,
            request_inputs=pages.inputs,
        )

    # ------------------------------------------------------------------ reading the curve
    @property
    def max_pages(self) -> int:
        """Capacity in pages beyond which the hit rate no longer grows (the largest stack
        position seen). ``O(1)``."""
        return len(self.token_hits) - 1

    @property
    def max_useful_tokens(self) -> int:
        """:attr:`max_pages` in tokens: a cache this large hits everything it could. ``O(1)``."""
        return self.max_pages * self.page_size

    @property
    def ideal_token_hit_rate(self) -> float:
        """The hit rate with unbounded capacity (the replay's ideal). ``O(1)``."""
        return float(self.token_hits[-1]) / self.prompt_tokens

    @property
    def ideal_block_hit_rate(self) -> float:
        """Block hit rate with unbounded capacity. ``O(1)``."""
        return float(self.block_hits[-1]) / self.blocks if self.blocks else 0.0

    def _pages(self, tokens: Any) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        if np.isnan(t).any() or (t < 0).any():
            raise ValueError("capacities must be >= 0 tokens (inf for unbounded)")
        return (np.minimum(t, self.max_useful_tokens) // self.page_size).astype(np.int64)

    def token_hit_rate(self, tokens: Any) -> Any:
        """Token hit rate of an LRU cache of ``tokens`` tokens (a number or an array;
        ``inf`` for unbounded). ``O(1)`` per capacity.

        >>> c = CapacityCurve.from_requests([TraceRequest(1, 0, 1024, 1, (0, 1))] * 2, page_size=512)
        >>> c.token_hit_rate([0, 512, 1024]).tolist(), c.token_hit_rate(float("inf"))
        ([0.0, 0.25, 0.5], 0.5)
        """
        rate = self.token_hits[self._pages(tokens)] / self.prompt_tokens
        return float(rate) if np.ndim(rate) == 0 else rate

    def block_hit_rate(self, tokens: Any) -> Any:
        """Block hit rate of an LRU cache of ``tokens`` tokens (a number or an array).
        ``O(1)`` per capacity."""
        rate = self.block_hits[self._pages(tokens)] / max(self.blocks, 1)
        return float(rate) if np.ndim(rate) == 0 else rate

    def tiers(self, device: float, host: float = 0, l3: float = 0) -> dict[str, float]:
        """Token hit rate served by each tier of an inclusive LRU hierarchy (module
        docstring): ``device`` is the curve at the device size, ``host`` the rise from there
        to the host size (0 if the host is not larger), ``l3`` the rise from the larger of
        the two to the L3 size; ``total`` is their sum. ``O(1)``.
        """
        d = self.token_hit_rate(device)
        h = self.token_hit_rate(max(device, host))
        total = self.token_hit_rate(max(device, host, l3))
        return {"device": d, "host": h - d, "l3": total - h, "total": total}

    def request_hit_tokens(self, tokens: int) -> np.ndarray:
        """Prompt tokens each request hits with an LRU cache of ``tokens`` (whole pages),
        in request order: the pages whose stack position is within the capacity, which
        (prefix closure, module docstring) are a prefix of the request's pages.
        ``O(pages)``; :class:`ValueError` on a curve built without per-request data."""
        if self.positions is None or self.request_pages is None:
            raise ValueError("this curve has no per-request data (build it with from_requests)")
        c = int(tokens) // self.page_size
        hit = (self.positions > 0) & (self.positions <= c)
        cs = np.concatenate(([0], np.cumsum(hit, dtype=np.int64)))
        ends = np.cumsum(self.request_pages)
        return (cs[ends] - cs[ends - self.request_pages]) * self.page_size

    def ttft(self, timing: TimingModel, device: int, host: int = 0, l3: int = 0) -> np.ndarray:
        """Estimated TTFT per request (seconds, :meth:`TimingModel.ttft`) with inclusive
        LRU tiers of these sizes: device hits are the hits at the device size, host hits
        the further hits up to the host size, L3 hits the rest up to the L3 size.
        ``O(pages)``."""
        d = self.request_hit_tokens(device)
        h = self.request_hit_tokens(max(device, host))
        t = self.request_hit_tokens(max(device, host, l3))
        return timing.ttft(self.request_inputs, d, h - d, t - h)

    def capacity_for(self, rate: float, *, block: bool = False) -> int | None:
        """The smallest capacity (tokens, whole pages) whose token (or block) hit rate is
        at least ``rate``; ``None`` if even unbounded capacity does not reach it.
        ``O(log max_pages)``.
        """
        hits, denominator = (self.block_hits, self.blocks) if block else (self.token_hits, self.prompt_tokens)
        need = rate * denominator
        if need > hits[-1] * (1 + 1e-12):
            return None
        return int(np.searchsorted(hits, need * (1 - 1e-12), side="left")) * self.page_size

    def knee(self, *, fraction: float = 0.99) -> int:
        """Capacity (tokens) at the knee of the curve, by Kneedle: on the capacity axis
        from 0 to the capacity reaching ``fraction`` of the ideal, both axes scaled to
        ``[0, 1]``, the point farthest above the diagonal. Past it, a token of capacity
        buys less hit rate than the average token up to there. ``O(max_pages)``.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if self.max_pages == 0:
            return 0
        top = max(1, int(np.searchsorted(self.token_hits, fraction * self.token_hits[-1], side="left")))
        if self.token_hits[top] == 0:
            return 0
        y = self.token_hits[: top + 1] / self.token_hits[top]
        x = np.arange(top + 1) / top
        return int(np.argmax(y - x)) * self.page_size

    def sizes(self, lo: int = 100_000) -> list[int]:
        """Round capacities (1-2-5 steps, tokens) from ``lo`` up to the first one past
        :attr:`max_useful_tokens`: the rows of ``hiradix plan``'s table. ``O(result)``."""
        out: list[int] = []
        decade = 10 ** max(0, len(str(max(lo, 1))) - 1)
        while len(out) < 64:
            for step in (1, 2, 5):
                size = step * decade
                if size >= lo:
                    out.append(size)
                if size >= self.max_useful_tokens and out:
                    return out
            decade *= 10
        return out

    def to_dict(self, sizes: Sequence[int] | None = None) -> dict[str, Any]:
        """Summary and the curve at ``sizes`` (default :meth:`sizes`), for JSON."""
        sizes = list(sizes if sizes is not None else self.sizes())
        return {
            "page_size": self.page_size,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "prompt_tokens": self.prompt_tokens,
            "blocks": self.blocks,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_useful_tokens": self.max_useful_tokens,
            "ideal_token_hit_rate": self.ideal_token_hit_rate,
            "ideal_block_hit_rate": self.ideal_block_hit_rate,
            "knee_tokens": self.knee(),
            "curve": [
                {"tokens": s, "token_hit_rate": self.token_hit_rate(s), "block_hit_rate": self.block_hit_rate(s)}
                for s in sizes
            ],
        }


# ---------------------------------------------------------------------------- recommendation
DEFAULT_PRICES = {"device": 300.0, "host": 5.0, "l3": 0.10}
"""Default prices per GiB of KV capacity (US dollars, rough 2025 purchase prices; override
them with your own):

* ``device``, GPU HBM: an H100 80 GB at about $25,000, all of it charged to its memory,
  about $300/GiB (the KV cache competes with weights and activations for the rest).
* ``host``, server DRAM (DDR5 RDIMM): about $5/GiB.
* ``l3``, NVMe SSD (enterprise TLC, about $100/TB): $0.10/GiB. For an L3 in other
  machines' DRAM (the peer cache), use the host price.
"""

LAYOUTS = (("device",), ("device", "host"), ("device", "host", "l3"))
"""The tier layouts :func:`recommend` compares."""


@dataclass(frozen=True)
class Plan:
    """Sizes (tokens) of each tier of one layout, what each tier serves and the cost."""

    layout: str  # "device", "device+host" or "device+host+l3"
    device_tokens: int
    host_tokens: int
    l3_tokens: int
    device_hit_rate: float
    host_hit_rate: float
    l3_hit_rate: float
    hit_rate: float
    device_gib: float
    host_gib: float
    l3_gib: float
    cost: float
    ttft_s: float | None = None  # the TTFT percentile asked for (recommend_for_ttft), seconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_prices(prices: dict[str, float]) -> dict[str, float]:
    """``DEFAULT_PRICES`` updated with ``prices``; :class:`ValueError` for an unknown tier
    or a price that is negative or not finite. ``O(1)``.

    >>> check_prices({"l3": 5})["l3"]
    5.0
    """
    out = dict(DEFAULT_PRICES)
    for tier, price in prices.items():
        if tier not in DEFAULT_PRICES:
            raise ValueError(f"unknown tier {tier!r} in prices: use {', '.join(DEFAULT_PRICES)}")
        value = float(price)
        if not 0 <= value < float("inf"):
            raise ValueError(f"price of {tier} must be a finite number >= 0 per GiB, got {price!r}")
        out[tier] = value
    return out


def recommend(
    curve: CapacityCurve,
    target: float,
    *,
    bytes_per_token: int,
    prices: dict[str, float] | None = None,
    min_device_tokens: int | None = None,
) -> list[Plan]:
    """The cheapest sizes of each layout of :data:`LAYOUTS` that reach a token hit rate of
    ``target``, cheapest first (the first is the recommendation).

    The hierarchy is inclusive (module docstring): the total hit rate is the curve at the
    largest tier, and each tier costs its own full size. So each layout puts the
    capacity the target needs, ``C = curve.capacity_for(target)``, in its lowest tier,
    and keeps the tiers above it at their floor: the device at ``min_device_tokens``
    (default: the longest prompt, so that every request fits, as the replayer requires),
    the host at the device's size (the L3 lands in the host, which holds the device's
    pages). A layout whose lower tier would add nothing (``C`` below the floor) is left
    out. ``bytes_per_token`` is the model's KV bytes per token
    (:attr:`~hiradix.sim.timing.ModelShape.bytes_per_token`); ``prices`` per GiB
    override :data:`DEFAULT_PRICES`.

    :class:`ValueError` if ``target`` is not in ``(0, 1]`` or exceeds what unbounded
    capacity reaches (the ideal), or for bad prices or sizes. ``O(log max_pages)``.
    """
    price = check_prices(prices or {})
    if not 0 < target <= 1:
        raise ValueError(f"target hit rate must be in (0, 1], got {target}")
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
    need = curve.capacity_for(target)
    if need is None:
        raise ValueError(
            f"target hit rate {target:.2%} is above the ideal {curve.ideal_token_hit_rate:.2%} "
            "(unbounded capacity) of this workload"
        )
    floor = _floor_tokens(curve, min_device_tokens)
    plans = []
    for layout in LAYOUTS:
        sizes = dict.fromkeys(TIERS, 0)
        for tier in layout:
            sizes[tier] = floor
        if len(layout) > 1 and need <= floor:
            continue  # the floor alone reaches the target: a lower tier adds only cost
        sizes[layout[-1]] = max(need, floor)
        plans.append(_plan(curve, layout, sizes, bytes_per_token, price))
    return sorted(plans, key=lambda p: p.cost)


def _plan(
    curve: CapacityCurve,
    layout: tuple[str, ...],
    sizes: dict[str, int],
    bytes_per_token: int,
    price: dict[str, float],
    ttft_s: float | None = None,
) -> Plan:
    rates = curve.tiers(sizes["device"], sizes["host"], sizes["l3"])
    gib = {tier: sizes[tier] * bytes_per_token / GIB for tier in TIERS}
    return Plan(
        layout="+".join(layout),
        device_tokens=sizes["device"],
        host_tokens=sizes["host"],
        l3_tokens=sizes["l3"],
        device_hit_rate=rates["device"],
        host_hit_rate=rates["host"],
        l3_hit_rate=rates["l3"],
        hit_rate=rates["total"],
        device_gib=gib["device"],
        host_gib=gib["host"],
        l3_gib=gib["l3"],
        cost=sum(gib[tier] * price[tier] for tier in TIERS),
        ttft_s=ttft_s,
    )


def _floor_tokens(curve: CapacityCurve, min_device_tokens: int | None) -> int:
    floor = curve.max_prompt_tokens if min_device_tokens is None else min_device_tokens
    if floor < 0:
        raise ValueError(f"min_device_tokens must be >= 0, got {floor}")
    return max(curve.page_size, -(-floor // curve.page_size) * curve.page_size)


def recommend_for_ttft(
    curve: CapacityCurve,
    timing: TimingModel,
    target_s: float,
    *,
    percentile: float = 90.0,
    bytes_per_token: int,
    prices: dict[str, float] | None = None,
    min_device_tokens: int | None = None,
    candidates: int = 48,
) -> list[Plan]:
    """The cheapest sizes of each layout of :data:`LAYOUTS` whose ``percentile`` TTFT
    (estimated per request with ``timing``, :meth:`CapacityCurve.ttft`) is at most
    ``target_s`` seconds, cheapest first; a layout that cannot reach it at any size is
    left out, and an empty list means none can.

    As in :func:`recommend`, the tiers above a layout's lowest one stay at their floor
    and the lowest one grows; but TTFT is not monotone in capacity (an L3 hit over a slow
    link can take longer than recomputing the tokens), so each layout is evaluated at
    ``candidates`` sizes spaced evenly on a log scale from the floor to the capacity that
    hits everything, and the smallest size that meets the target is taken: a plan is the
    cheapest of those sizes, not of every size. Each :attr:`Plan.ttft_s` is the
    percentile reached. ``O(candidates x layouts x pages)``.
    """
    price = check_prices(prices or {})
    if not target_s > 0:
        raise ValueError(f"target TTFT must be > 0 seconds, got {target_s}")
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    if bytes_per_token < 1:
        raise ValueError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
    ps = curve.page_size
    floor = _floor_tokens(curve, min_device_tokens)
    top = max(floor, curve.max_useful_tokens)
    grid = np.unique(np.geomspace(floor, top, candidates).astype(np.int64) // ps * ps)
    grid = grid[grid >= floor]
    plans = []
    for layout in LAYOUTS:
        for size in grid:
            sizes = dict.fromkeys(TIERS, 0)
            for tier in layout:
                sizes[tier] = floor
            sizes[layout[-1]] = int(size)
            if len(layout) > 1 and size <= floor:
                continue  # the same as the layout without this tier
            reached = float(np.percentile(curve.ttft(timing, sizes["device"], sizes["host"], sizes["l3"]), percentile))
            if reached <= target_s:
                plans.append(_plan(curve, layout, sizes, bytes_per_token, price, reached))
                break
    return sorted(plans, key=lambda p: p.cost)


# ---------------------------------------------------------------------------- plot
def plot_curve(
    curve: CapacityCurve,
    title: str,
    *,
    marks: dict[str, int] | None = None,
    bytes_per_token: int | None = None,
    block: bool = False,
) -> Any:
    """The token (or block) hit rate against capacity, log capacity axis from one page's
    worth to past :attr:`~CapacityCurve.max_useful_tokens`, with the ideal, the knee and
    ``marks`` (label -> tokens, e.g. the recommended sizes) drawn in. With
    ``bytes_per_token`` a second axis gives GiB. Returns a matplotlib ``Figure``.
    ``O(max_pages)``.
    """
    fig = figure(figsize=(8, 4.8), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    hits, denominator = (curve.block_hits, curve.blocks) if block else (curve.token_hits, curve.prompt_tokens)
    # Four decades below the capacity that hits everything: smaller caches hold a few
    # prompts at most, and the curve there is flat or approximate (module docstring).
    top = max(curve.max_pages, 2)
    pages = np.unique(np.geomspace(max(1, top // 10_000), top, 2000).astype(np.int64))
    x = pages * curve.page_size
    y = 100 * hits[pages] / denominator
    ideal = 100 * hits[-1] / denominator
    ax.plot(x, y, color="C0", lw=2, label=f"LRU, page {curve.page_size}")
    ax.axhline(ideal, color="0.5", ls="--", lw=1, label=f"ideal (unbounded): {ideal:.1f}%")
    knee = curve.knee()
    if knee:
        ky = 100 * hits[knee // curve.page_size] / denominator
        ax.plot([knee], [ky], "o", color="C3", ms=7, label=f"knee: {format_size(knee)} tokens, {ky:.1f}%")
    grouped: dict[int, list[str]] = {}
    for label, tokens in (marks or {}).items():
        if tokens > 0:
            grouped.setdefault(tokens, []).append(label)
    for color, (tokens, labels) in zip(("C1", "C2", "C4", "C5", "C6", "C7"), grouped.items(), strict=False):
        my = 100 * hits[min(tokens // curve.page_size, curve.max_pages)] / denominator
        ax.axvline(tokens, color=color, ls=":", lw=1.2)
        text = f"{', '.join(labels)}: {format_size(tokens)} tokens, {my:.1f}%"
        ax.plot([tokens], [my], "s", color=color, ms=5, label=text)
    ax.set_xscale("log")
    ax.set_xlim(x[0], x[-1] * 1.5)
    ax.set_ylim(0, ideal * 1.1 + 1)
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel(f"{'block' if block else 'token'} hit rate (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    if bytes_per_token:
        scale = bytes_per_token / GIB

        def to_gib(tokens: Any) -> Any:
            return tokens * scale

        def to_tokens(gib: Any) -> Any:
            return gib / scale

        ax.secondary_xaxis("top", functions=(to_gib, to_tokens)).set_xlabel("KV capacity (GiB)")
    return fig


def format_size(tokens: int) -> str:
    """A token count to three significant digits: ``126k``, ``17.9M``.

    >>> format_size(126_192), format_size(17_872_512), format_size(512)
    ('126k', '17.9M', '512')
    """
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{suffix}"
    return str(tokens)

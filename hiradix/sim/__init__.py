"""Trace-driven simulation of the tiered radix cache (the ``hiradix sim`` command).

* :mod:`hiradix.sim.trace` reads Mooncake-format traces.
* :mod:`hiradix.sim.generators` yields the same records from seeded synthetic workloads
  (system prompts, chats, agent loops) and from the Azure arrival/length traces.
* :mod:`hiradix.sim.replay` replays requests through the tree with one slot pool per tier
  and counts hits per tier against the infinite-capacity ideal.
* :mod:`hiradix.sim.timing` turns the hits into TTFT, throughput and bytes moved;
  :mod:`hiradix.sim.advice` says where a tier makes TTFT worse, why, and what would change it.
* :mod:`hiradix.sim.run` ties a workload, the replayer and the timing model together;
  :mod:`hiradix.sim.report` writes the summary, JSON, plots and HTML;
  :mod:`hiradix.sim.sweep` runs grids of configurations on every core.
* :mod:`hiradix.sim.curve` gives the LRU hit rate at every capacity from one pass (LRU
  stack positions over pages) and the cheapest tier sizes for a target hit rate.
"""

from __future__ import annotations

from hiradix.sim.replay import (
    PREFETCH_OUTCOMES,
    Replayer,
    ReplayStats,
    RequestRecord,
    Served,
    hit_blocks,
)
from hiradix.sim.trace import BLOCK_TOKENS, MAX_BLOCK_ID, MooncakeTrace, TraceError, TraceRequest, parse_line

__all__ = [
    "BLOCK_TOKENS",
    "MAX_BLOCK_ID",
    "PREFETCH_OUTCOMES",
    "MooncakeTrace",
    "ReplayStats",
    "Replayer",
    "RequestRecord",
    "Served",
    "TraceError",
    "TraceRequest",
    "hit_blocks",
    "parse_line",
]

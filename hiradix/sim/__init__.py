"""Trace-driven simulation of the tiered radix cache (the ``hiradix sim`` command).

:mod:`hiradix.sim.trace` reads Mooncake-format traces; :mod:`hiradix.sim.replay` replays
them through the tree with one slot pool per tier and counts hits per tier against the
infinite-capacity ideal.
"""

from __future__ import annotations

from hiradix.sim.replay import Replayer, ReplayStats, Served, SlotPool, hit_blocks
from hiradix.sim.trace import BLOCK_TOKENS, MAX_BLOCK_ID, MooncakeTrace, TraceError, TraceRequest, parse_line

__all__ = [
    "BLOCK_TOKENS",
    "MAX_BLOCK_ID",
    "MooncakeTrace",
    "ReplayStats",
    "Replayer",
    "Served",
    "SlotPool",
    "TraceError",
    "TraceRequest",
    "hit_blocks",
    "parse_line",
]

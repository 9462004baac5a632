"""Simulate a tiered KV cache on a synthetic chat workload, in a few lines.

Generates 300 multi-turn chat requests (seeded, so every run is the same), replays them
through the radix tree with a small GPU tier and a larger host tier, prints the hit
rates and the TTFT the timing model estimates for Llama-3-8B, and compares eviction
policies. Add ``report.write_html(result, "report.html")`` for plots in one file.

Run: ``python examples/sim_quickstart.py``
"""

from __future__ import annotations

from hiradix.sim import report
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.run import simulate
from hiradix.sim.sweep import grid, run_sweep, sweep_table
from hiradix.sim.timing import MODELS, TimingModel

workload = ChatWorkload(requests=300, seed=7)
timing = TimingModel(model=MODELS["llama-3-8b"])

# One run: 50k device tokens (GPU), 200k host tokens (CPU memory).
result = simulate(workload, timing=timing, device_tokens=50_000, host_tokens=200_000)
print(report.summary(result))

# A small sweep, in this process (jobs=1); use jobs=None for one worker per core.
rows = run_sweep(workload, grid([25_000, 50_000, 100_000], [200_000], ["lru", "sieve"], ["write_through"]), jobs=1)
print()
print(sweep_table(rows))

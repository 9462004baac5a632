"""One rank of the adapter's multi-rank test (spawned by test_sglang_tp): SGLang's objects
built per rank, the TP group from ``torch.distributed``, the same seeded scheduler loop on
every rank, and rank-local host-allocation faults on one of them."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch


def rank_main(rank: int, world: int, rendezvous: str, out_dir: str, config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from tests.sglang.v18.env import build
    from tests.sglang.v18.test_scheduler_loop import Loop
    from tests.support import HostAllocFaults
    from tests.support.scheduler_loop import tree_fingerprint

    group = torch.distributed.group.WORLD if config["agree"] else None
    if config.get("pp"):
        # the ranks as pipeline stages, as SGLang's scheduler builds them: the first stage
        # decides, the later ones take its decisions, so its faults are the ones to agree on
        env = build(
            config["page"],
            size=256,
            layout="page_first",
            write_policy=config["write_policy"],
            params={"pp_cache_group": group, "pp_rank": rank, "pp_size": world},
        )
        faulty = 0
    else:
        env = build(config["page"], size=256, layout="page_first", write_policy=config["write_policy"], tp_group=group)
        faulty = 1
    faults = HostAllocFaults(env.cache.core.host_pool, seed=99) if rank == faulty else None  # this rank alone
    loop = Loop(env, seed=config["seed"])
    for _ in range(config["steps"]):
        loop.step()
    loop.drain()
    fingerprint = tree_fingerprint(env.cache.core, env.cache.namespace_roots())
    result = {
        "fingerprint": hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest(),
        "stats": loop.stats,
        "failures": faults.failures if faults else 0,
        "calls": env.cache.core.agreement.calls,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    env.cache.core.close()
    torch.distributed.destroy_process_group()

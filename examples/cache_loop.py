"""A scheduler-like loop over HiRadixCache: what a serving engine does per step.

Requests share a system prompt and earlier turns. Each step admits requests (match the
cached prefix, load any host-only tail back, lock it, allocate device slots for the rest),
runs a "forward pass" that waits for the loaded KV layer by layer and writes the new KV,
then finishes the requests (insert, back up per the write policy) and lets the cache
acknowledge its copies. The device pool is small, so older KV is evicted to the host
and later loaded back.

Run: ``python examples/cache_loop.py``
"""

from __future__ import annotations

import numpy as np
import torch

from hiradix.cache import HiRadixCache, Req, TreeOptions
from hiradix.memory import DeviceKVPool, HostKVPool, MHAShape

PAGE = 16
device = DeviceKVPool(MHAShape(layer_num=4, head_num=2, head_dim=8), size=768, page_size=PAGE, dtype=torch.float16)
host = HostKVPool.for_device(device, ratio=8.0, layout="page_first", reserve_bytes=0)
rng = np.random.default_rng(0)
system = rng.integers(0, 32_000, 128)  # a shared system prompt
conversations = [system.copy() for _ in range(6)]

reused = loaded = computed = rejected = 0
with HiRadixCache(device, host, tree=TreeOptions(write_policy="write_through")) as cache:
    counter = cache.cache_controller.layer_done_counter
    for step in range(20):
        batch = []
        for c in rng.choice(len(conversations), size=2, replace=False):
            turn = rng.integers(0, 32_000, int(rng.integers(20, 80)))
            prompt = np.concatenate((conversations[c], turn))
            # ---- admit: match, load back the host tail, lock, allocate the rest
            m = cache.match_prefix(prompt)
            back, node = cache.init_load_back(m.last_node, m.host_hit_length)
            cache.inc_lock_ref(node)
            prefix = torch.cat((m.device_indices, back))
            new = cache.alloc_device(-(-(len(prompt) - len(prefix)) // PAGE) * PAGE)
            if new is None:  # no room even after evicting (KV being backed up is locked): later
                cache.dec_lock_ref(node)
                rejected += 1
                continue
            new = new[: len(prompt) - len(prefix)]
            batch.append((c, prompt, prefix, new, node))
            reused += len(m.device_indices)
            loaded += len(back)
            computed += len(new)
        # ---- forward pass: layer i may run once layer i of the load has landed
        counter.set_consumer(cache.ready_to_load_host_cache())
        for layer in range(device.layer_num):
            counter.wait_until(layer)
            for _, _, _, new, _ in batch:  # "compute" the new tokens' KV of this layer
                device.k_buffer(layer)[new] = 1.0
                device.v_buffer(layer)[new] = 1.0
        # ---- finish: insert, free duplicates and the unaligned tail, release the lock
        for c, prompt, prefix, new, node in batch:
            cache.cache_finished_req(Req(f"{step}.{c}", prompt, torch.cat((prefix, new)), prefix, node))
            conversations[c] = prompt if len(prompt) < 320 else system.copy()  # long: start a new chat
        cache.check_hicache_events()
        cache.check_invariants()
    cache.flush()
    cache.check_invariants()
    stats = cache.stats

print(f"prompt tokens: {reused:,} reused on the device, {loaded:,} loaded back from the host, {computed:,} computed")
print(f"requests deferred for lack of device room: {rejected}")
print(
    f"cache: {stats['backup_done_tokens']:,} tokens backed up to the host, "
    f"{stats['device_evicted_tokens']:,} evicted from the device, {stats['load_back_tokens']:,} loaded back"
)

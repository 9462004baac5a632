"""HiRadixCache with a file-backed L3: a prefix goes device -> host -> files, leaves the
device and the host, and comes back from the files byte for byte.

1. Insert a prompt's KV on the device; write-through backs it up to the host, and each
   backed-up node is written on to the L3 (FileStorage in a temporary folder).
2. Evict it from the device and then from the host: only the files hold it.
3. A new request with the same prefix matches nothing in memory; the cache prefetches
   the pages from L3 into the host, loads them to the device, and the bytes are the
   ones written in step 1.

Run: ``python examples/file_l3.py``
"""

from __future__ import annotations

import tempfile

import numpy as np
import torch

from hiradix.cache import HiRadixCache, Req, StorageOptions
from hiradix.cache.l3 import PrefetchConfig
from hiradix.memory import DeviceKVPool, HostKVPool, MLAShape
from hiradix.storage.file import FileStorage

PAGE = 16
device = DeviceKVPool(
    MLAShape(layer_num=2, kv_lora_rank=32, qk_rope_head_dim=8), size=512, page_size=PAGE, dtype=torch.bfloat16
)
host = HostKVPool.for_device(device, ratio=2.0, layout="page_first", reserve_bytes=0)
prompt = np.arange(1000, 1000 + 256)

with tempfile.TemporaryDirectory() as folder, FileStorage(path=folder) as storage:
    prefetch = PrefetchConfig(policy="wait_complete", threshold_tokens=PAGE)
    with HiRadixCache(device, host, storage=StorageOptions(backend=storage, prefetch=prefetch)) as cache:
        # 1. compute the KV (random values), insert, back up to host and L3
        slots = cache.alloc_device(len(prompt))
        assert slots is not None
        for layer in range(device.layer_num):
            device.kv_buffer(layer)[slots] = torch.randn(len(prompt), 1, 40).to(torch.bfloat16)
        original = [device.kv_buffer(layer)[slots].clone() for layer in range(device.layer_num)]
        cache.cache_finished_req(Req("first", prompt, slots))
        cache.flush()  # the host copy has landed
        cache.check_hicache_events()  # ... and its L3 write is queued
        while cache.storage.pending_storage()[1]:  # wait for the L3 writes to be acknowledged
            cache.storage.check_backup_progress()
        print(f"stored in L3: {storage.get_stats().pages} pages under {folder}")

        # 2. evict from the device (demoted to the host), then from the host
        print(f"evicted {cache.evict(len(prompt))} device tokens, {cache.evict_host(len(prompt))} host tokens")
        m = cache.match_prefix(prompt)
        assert len(m.device_indices) == m.host_hit_length == 0, "nothing left in memory"

        # 3. prefetch from L3 into the host, load to the device, compare
        mount, mounted = cache.storage.prefetch_mount(m)
        assert cache.storage.prefetch_from_storage("second", mount, prompt[mounted:])
        while not cache.storage.check_prefetch_progress("second"):  # wait_complete: until the I/O is done
            cache.storage.wait_prefetch("second", 1.0)
        print(f"prefetched {cache.storage.pop_prefetch_loaded_tokens('second')} tokens from L3 into the host")
        m = cache.match_prefix(prompt)
        loaded, node = cache.init_load_back(m.last_node, m.host_hit_length)
        counter = cache.cache_controller.layer_done_counter
        counter.set_consumer(cache.ready_to_load_host_cache())
        for layer in range(device.layer_num):
            counter.wait_until(layer)
            assert torch.equal(device.kv_buffer(layer)[loaded], original[layer]), f"layer {layer} differs"
        print(f"loaded {len(loaded)} tokens back to the device: identical bytes in all {device.layer_num} layers")
        cache.check_hicache_events()
        cache.check_invariants()

"""The tiered radix tree in a few lines: insert, back up, evict to host, match, load back.

The tree only keeps books: it says which KV slots to free, copy or load, and the caller
(here, plain integers standing in for GPU and host KV slots) does the moving.

Run: ``python examples/tree_basics.py``
"""

from __future__ import annotations

import numpy as np

import hiradix

tree = hiradix.HiRadixTree(page_size=4, write_policy="write_through")
print(f"tree: {hiradix.IMPLEMENTATION} implementation, page size {tree.page_size}")

# 1. A request's prompt lands on the GPU (device slots 0..7) and is inserted.
prompt = np.arange(100, 108)
inserted = tree.insert(prompt, np.arange(0, 8))
print(f"insert 8 tokens: {tree.device_size()} on device; write-through asks to back up {inserted.backup_nodes}")

# 2. Write-through: copy each reported node to host slots (parents first), two-phase.
for node in inserted.backup_nodes:
    n = len(tree.key(node))
    device_slots = tree.begin_backup(node, np.arange(1000, 1000 + n))  # what to copy GPU -> host
    tree.commit_backup(node, ok=True)  # the copy landed
    print(f"backed up node {node}: device slots {device_slots.tolist()} -> host slots 1000..{999 + n}")

# 3. GPU memory is needed elsewhere: evict. A backed-up leaf becomes host-only.
evicted = tree.evict(8)
print(f"evict: freed device slots {evicted.device_indices.tolist()}; device {tree.device_size()}, "
      f"host {tree.host_size()} tokens")  # fmt: skip

# 4. The same conversation comes back with 2 more pages: the prefix is a host hit.
follow_up = np.arange(100, 116)
match = tree.match_prefix(follow_up)
print(f"match 16 tokens: device hit {len(match.device_indices)}, host hit {match.host_hit_length}")

# 5. Load the host hit back into fresh device slots (two-phase), then insert the rest.
host_slots = tree.evicted_host_indices(match.last_node)  # what to copy host -> GPU
tree.begin_load_back(match.last_node, np.arange(20, 28))
tree.finish_load_back(match.last_node)
print(f"load back host slots {host_slots.tolist()} -> device slots 20..27")
inserted = tree.insert(follow_up, np.concatenate((np.arange(20, 28), np.arange(28, 36))))
print(f"insert the follow-up: {inserted.prefix_len} tokens were already on the device")

match = tree.match_prefix(follow_up)
print(f"match again: device hit {len(match.device_indices)}, host hit {match.host_hit_length}")
tree.check_invariants()

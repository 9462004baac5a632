"""A three-node peer cache in one process: publish on one node, read on another.

Pages stay in the producer's published pool; the reader finds them through the
consistent-hash directory and READs them over the TCP transport (loopback), verifying every
slot before copying it out. Run:

    python examples/peer_cluster.py
"""

from __future__ import annotations

import hashlib

import numpy as np

from hiradix.peer.node import InProcessCluster
from hiradix.peer.store import PeerCacheStore


def main() -> None:
    with InProcessCluster(3, transport="tcp", pool_size=16 << 20) as cluster:
        producer, reader, _ = (PeerCacheStore(node=n) for n in cluster.nodes)
        keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(32)]
        pages = [np.random.default_rng(i).integers(0, 256, 64 << 10, dtype=np.uint8) for i in range(32)]
        assert producer.batch_set(keys, pages)
        print("exists on the reader:", reader.batch_exists(keys), "of", len(keys))
        got = reader.batch_get(keys)
        assert all(g is not None and bytes(g.numpy()) == p.tobytes() for g, p in zip(got, pages, strict=True))
        print("read back 32 x 64 KiB pages from", producer.node.node_id, "on", reader.node.node_id)
        st = reader.node.status()
        print("members:", st["members"], "masters:", st["masters"], "hit rate:", st["hit_rate"])


if __name__ == "__main__":
    main()

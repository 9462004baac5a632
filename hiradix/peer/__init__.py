"""The peer cache: the default L3, reading KV pages from other nodes' host memory.

- :mod:`~hiradix.peer.node`: :class:`~hiradix.peer.node.PeerNode`, one node with all of the
  below wired together, and :class:`~hiradix.peer.node.InProcessCluster` for tests;
- :mod:`~hiradix.peer.producer`: the pages a node publishes (pools, evictions, disk tier,
  promote); :mod:`~hiradix.peer.reader`: every read path (local, promoted, remote READ in
  place or staged, verified); :mod:`~hiradix.peer.sync`: the directory kept in step with
  the live members (re-publish, hand-offs) and the node's readiness;
- :mod:`~hiradix.peer.store`: :class:`~hiradix.peer.store.PeerCacheStore`, the node as a
  storage backend (``"peer"``), loadable by SGLang;
- :mod:`~hiradix.peer.pool`: the published pool, self-verifying slots peers READ;
- :mod:`~hiradix.peer.directory` and :mod:`~hiradix.peer.ring`: where each key's entry
  lives (consistent hashing, replicated shards);
- :mod:`~hiradix.peer.membership`: discovery masters and heartbeats;
- :mod:`~hiradix.peer.keyhash`: the key digests slots and the ring are addressed by;
- :mod:`~hiradix.peer.disk`: the optional disk tier under the pool;
- :mod:`~hiradix.peer.metrics`: Prometheus metrics, the ``/`` dashboard and ``/ready``;
- :mod:`~hiradix.peer.config` and :mod:`~hiradix.peer.cli`: settings and ``hiradix peer``.

Nothing is imported here: ``import hiradix.peer`` stays cheap.
"""

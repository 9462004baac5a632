"""``PeerCacheStore``: the peer cache as an L3 storage backend.

Registered as ``"peer"`` (``create_backend("peer", config)``) and loadable by stock SGLang as
a ``dynamic`` HiCache storage backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "peer",
        "module_path": "hiradix.peer.store", "class_name": "PeerCacheStore",
        "discovery_addr": "10.0.0.1:7000", "pool_size": "8GiB"}'

Every key of the extra config that names a :class:`~hiradix.peer.config.PeerConfig` field
configures the embedded node; besides those:

``capacity_bytes``  published-pool bytes (an alias of ``pool_size``)
``seeds``           more master RPC addresses to join through (list of ``"host:port"``)
``heartbeat_s``     heartbeat period (default 1 s; a member dies after 3 periods)
``recv_bytes``      size of the receive region (default 64 MiB)
``inprocess_nodes`` start that many nodes in this process (loopback) and attach to the
                    first: a self-contained cluster for tests and the simulator
``transport``       the node's transport (``PeerConfig.transport``: ``"auto"`` by default,
                    ``"tcp"``, ``"rdma"``); with ``inprocess_nodes``, ``"tcp"`` (default)
                    or ``"fake"`` (the in-process fake NIC)
``path``            the disk tier's directory when ``disk_enabled`` (``disk_path`` wins)

Semantics, on top of :class:`~hiradix.storage.base.StorageBackend`:

- ``set`` is one memcpy into a published-pool slot plus a directory PUT to the key's
  replica owners; the bytes never leave this node until someone reads them.
- ``get`` is a batched directory lookup (one RPC per owner) and one transport READ batch
  per producer. For the in-place v1 calls the host KV pool is registered as a *local
  receive* region (never published: no peer can read it), and each slot is READ as two
  items, its header into the receive region and its payload straight into the host page,
  then verified in place (magic, key digest, generation, CRC): no copy. Other
  destinations get whole slots in the receive region, verified, then copied out. Pages
  this node published are a local memcpy. Anything that fails is a miss, never wrong
  bytes (a missed page's bytes are unspecified and ``batch_get_v1`` returns ``False``).
- ``batch_exists`` is one batched lookup, longest prefix. Disk-resident pages count as
  hits and are promoted in the background so the following ``get`` is warm.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from hiradix.peer.config import PeerConfig
from hiradix.peer.node import InProcessCluster, PeerNode
from hiradix.storage.base import SGLANG_LOADER_KEYS, Capabilities, StorageBackend, StorageConfig

__all__ = ["PeerCacheStore"]

log = logging.getLogger(__name__)

_STORE_OPTIONS = ("capacity_bytes", "seeds", "heartbeat_s", "recv_bytes", "inprocess_nodes", "transport", "path")
_IGNORED = SGLANG_LOADER_KEYS


def _as_storage_config(config: Any) -> StorageConfig | None:
    """Our :class:`StorageConfig`, from ours or from SGLang's ``HiCacheStorageConfig``."""
    if config is None or isinstance(config, StorageConfig):
        return config
    return StorageConfig.from_sglang(config)


class PeerCacheStore(StorageBackend):
    """The peer cache as a :class:`StorageBackend` (module docstring).

    Parameters
    ----------
    config:
        Our :class:`StorageConfig` or SGLang's storage config; ``extra_config`` configures
        the node (module docstring).
    kwargs:
        SGLang's dynamic loader passes a second positional mapping; it is merged into the
        extra config (keys naming a setting) and otherwise ignored.
    node:
        Attach to this running node instead of starting one (not closed by :meth:`close`).
    """

    name: ClassVar[str] = "peer"
    capabilities = Capabilities(supports_v1=True, zero_copy=False, persistent=False, shared=True)

    def __init__(
        self, config: Any = None, kwargs: Mapping[str, Any] | None = None, *, node: PeerNode | None = None
    ) -> None:
        super().__init__(_as_storage_config(config))
        self._cluster: InProcessCluster | None = None
        self._owns_node = node is None
        if node is None:
            node = self._start_node({**self.config.extra_config, **dict(kwargs or {})})
        self.node = node
        self._receive_handle: int | None = None
        node.on_evictions = lambda n: self._count(evictions=n)

    def _start_node(self, extra: dict[str, Any]) -> PeerNode:
        fields = {f.name for f in dataclasses.fields(PeerConfig)}
        settings: dict[str, Any] = {}
        unknown = []
        for k, v in extra.items():
            if k in fields:
                settings[k] = v
            elif k not in _STORE_OPTIONS and k not in _IGNORED and not k.startswith("_"):
                unknown.append(k)
        if unknown:
            log.warning("peer store: ignoring unknown extra config keys %s", sorted(unknown))
        if extra.get("capacity_bytes") is not None:
            settings["pool_size"] = extra["capacity_bytes"]
        if extra.get("path") is not None:
            settings.setdefault("disk_path", extra["path"])
        settings.setdefault("metrics_enabled", False)
        n = int(extra.get("inprocess_nodes") or 0)
        if n:
            # In-process nodes run TCP on loopback unless told "fake" (InProcessCluster's own choice).
            settings.pop("transport", None)
            self._cluster = InProcessCluster(n, transport=str(extra.get("transport", "tcp")), **settings)
            return self._cluster.nodes[0]
        return PeerNode(
            PeerConfig.from_dict(settings),
            seeds=list(extra.get("seeds") or ()),
            heartbeat_s=float(extra.get("heartbeat_s", 1.0)),
            recv_bytes=int(extra.get("recv_bytes", 64 << 20)),
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach the host pool and register it with the node's transport as a *local
        receive* region (pages that are one run of it), so remote payloads are READ straight into
        their pages. It is never published: no peer can read it. ``O(regions)``."""
        super().register_mem_pool_host(mem_pool_host)
        if self._receive_handle is not None:
            self.node.deregister_receive(self._receive_handle)
            self._receive_handle = None
        if mem_pool_host.pages_in_place:
            try:
                self._receive_handle = self.node.register_receive(mem_pool_host.pages_array())
            except ValueError as exc:  # overlaps a region already registered: the staged path
                log.warning("peer store: host pool not registered for direct reads: %s", exc)

    # ------------------------------------------------------------------ primitives
    def _exists(self, key: str) -> bool:
        return self.node.exists_prefix([key]) == 1

    def _exists_many(self, keys: list[str]) -> int:
        return self.node.exists_prefix(keys)

    def _size(self, key: str) -> int | None:
        e = self.node.lookup([key])[0]
        # A length no READ could fetch is a bad entry: this key's miss, not an allocation
        # that fails the whole batch_get.
        return None if e is None or e.length > self.node.max_page_bytes else e.length

    def _get_into(self, key: str, out: memoryview) -> bool:
        return self.node.read_into([key], [out])[0]

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        return self.node.read_into(keys, outs)

    def _get_many_at(self, keys: list[str], addrs: np.ndarray, lengths: np.ndarray, hold: Any) -> list[bool] | None:
        # The page-first v1 get: raw page addresses straight to the node's batch path.
        return self.node.read_pages(keys, addrs, lengths, hold=hold).tolist()  # type: ignore[no-any-return]

    def _put(self, key: str, data: memoryview) -> bool:
        return self.node.publish_many([key], [data])[0]

    def _put_many(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        return self.node.publish_many(keys, views)

    def _clear(self) -> None:
        self.node.delete_all()

    def _usage(self) -> tuple[int, int, int | None]:
        return len(self.node.published()), self.node.pool_used_bytes, self.node.config.pool_size

    def _extra_stats(self) -> dict[str, Any]:
        st = self.node.status()
        return {
            "node_id": st["node_id"],
            "members": len(st["members"]),
            "directory_entries": st["directory_entries"],
            "stale_reads": st["stale_reads"],
            "pool_evictions": st["pool"]["evictions"],
        }

    def close(self) -> None:
        """Stop the node (and the in-process cluster) this store started. Idempotent."""
        if self._receive_handle is not None and not self._owns_node:
            self.node.deregister_receive(self._receive_handle)
        self._receive_handle = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        elif self._owns_node:
            self.node.close()

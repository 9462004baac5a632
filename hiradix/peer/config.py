"""Configuration of the peer cache: one frozen, validated dataclass.

:class:`PeerConfig` carries the seed's knobs with its defaults (3 masters, 160 virtual nodes,
2 directory replicas, 16 channels per peer, metrics on port 31997) plus the pool, disk and
timeout settings. Construct it directly, or load it from a JSON or TOML file
(:meth:`PeerConfig.from_file`); every value is checked in ``__post_init__`` and errors name
the field, the value and what was expected. Unknown keys are rejected with a suggestion, so a
typo never silently falls back to a default.

Sizes accept integers (bytes) or strings with a unit: ``"64KiB"``, ``"4GiB"``, ``"100GB"``
(``K/M/G/T`` are powers of 1000, ``Ki/Mi/Gi/Ti`` powers of 1024).

>>> cfg = PeerConfig.from_dict({"pool_size": "256MiB", "directory_replicas": 3})
>>> cfg.pool_size, cfg.directory_replicas, cfg.virtual_nodes
(268435456, 3, 160)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hiradix import envvars
from hiradix.net.address import WILDCARD_HOSTS, default_advertise_host, is_ipv6, is_loopback
from hiradix.settings import ConfigError, GiB, parse_size

if TYPE_CHECKING:
    from hiradix.peer.producer import ProducerSettings
    from hiradix.peer.reader import ReaderSettings
    from hiradix.peer.sync import SyncSettings
    from hiradix.peer.transports import TransportChoice
    from hiradix.transport.base import TransportSettings

__all__ = [
    "ConfigError",
    "PeerConfig",
]

_HOST_RE = re.compile(r"^[A-Za-z0-9_.-]+$")  # a host name or an IPv4 address
TOKEN_ENV = "HIRADIX_CLUSTER_TOKEN"


def _check_transport(kind: Any) -> None:
    """``ConfigError`` unless ``kind`` is one of the transport chooser's kinds
    (:data:`hiradix.peer.transports.TRANSPORTS`; imported here, as the parts' settings are)."""
    from hiradix.peer.transports import TRANSPORTS

    if kind not in TRANSPORTS:
        raise ConfigError(f"transport: expected one of {', '.join(repr(t) for t in TRANSPORTS)}, got {kind!r}")


_SIZE_FIELDS = ("pool_size", "page_size", "disk_size")
_TIMEOUT_FIELDS = (
    "join_timeout_s",
    "connect_timeout_s",
    "rpc_timeout_s",
    "read_timeout_s",
    "promote_timeout_s",
    "idle_timeout_s",
)


@dataclass(frozen=True)
class PeerConfig:
    """Settings of one peer-cache node.

    Attributes
    ----------
    node_id:
        This node's id on the ring; ``None``: the store derives ``host:rpc_port``.
    bind_host:
        Address every listener binds (RPC, data, discovery). Loopback by default; any other
        address requires a cluster token (here or in ``$HIRADIX_CLUSTER_TOKEN``).
    advertise_addr:
        The host (name or address, no port) other nodes reach this one at, which also names
        the node; ``None``: ``bind_host``, or for a wildcard bind the address of the default
        route's interface (:func:`default_advertise_host`). Never a wildcard.
    rpc_port, data_port:
        Control-plane RPC (which also serves discovery) and TCP data-plane ports; ``0`` picks
        a free port.
    discovery_addr:
        ``"host:port"`` of the head master; ``None``: the first seed, or this node when it
        has none.
    join_timeout_s:
        Seconds a starting node keeps trying its seeds before it gives up (fails to start,
        or runs alone when allowed to).
    max_masters:
        Discovery masters kept active (head first, then by hostname).
    virtual_nodes:
        Ring points per node.
    directory_replicas:
        Owners that hold each directory entry.
    max_channels_per_peer:
        Channel (QP + CQ, or socket) cap per remote peer.
    transport:
        The data plane: ``"tcp"``, ``"rdma"`` (libibverbs; fails to start without an ACTIVE
        RDMA port), ``"fake"`` (the in-process fake NIC; tests) or ``"auto"``: RDMA where
        an ACTIVE port exists, else TCP (one INFO line says why).
    pool_size:
        Bytes of the published pool region.
    page_size:
        Bytes of one KV page (one pool slot's payload); ``None``: taken from the host KV pool
        when the store attaches.
    pool_policy:
        Eviction policy of the published pool (``"lru"``).
    disk_enabled, disk_path, disk_size, disk_queue_depth:
        The optional L4 disk tier (see :mod:`hiradix.peer.disk`).
    metrics_enabled, metrics_host, metrics_port, metrics_dashboard:
        The metrics server; ``metrics_host`` ``None`` means ``bind_host``.
    cluster_token:
        Shared secret of the RPC handshake; ``None``: read ``$HIRADIX_CLUSTER_TOKEN``. Never
        shown by ``repr``.
    connect_timeout_s, rpc_timeout_s, read_timeout_s, promote_timeout_s:
        Seconds before a connect, a directory RPC, a batch READ or a disk promote gives up
        (and the page is a miss).
    max_connections, idle_timeout_s:
        Per listener (RPC and data): connections served at once (more are closed at
        accept), and seconds an idle connection is kept before it is closed.
    """

    node_id: str | None = None
    bind_host: str = "127.0.0.1"
    advertise_addr: str | None = None
    rpc_port: int = 0
    data_port: int = 0
    discovery_addr: str | None = None
    max_masters: int = 3
    virtual_nodes: int = 160
    directory_replicas: int = 2
    max_channels_per_peer: int = 16
    transport: str = "auto"
    pool_size: int = 1 * GiB
    page_size: int | None = None
    pool_policy: str = "lru"
    disk_enabled: bool = False
    disk_path: str = "/data/hiradix/peer"
    disk_size: int = 100 * GiB
    disk_queue_depth: int = 256
    metrics_enabled: bool = True
    metrics_host: str | None = None
    metrics_port: int = 31997
    metrics_dashboard: bool = True
    cluster_token: str | None = field(default=None, repr=False)
    join_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    rpc_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    promote_timeout_s: float = 10.0
    max_connections: int = 1024
    idle_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:  # accept "64KiB" in code too, not only in files
            v = getattr(self, name)
            if v is not None and isinstance(v, str):
                object.__setattr__(self, name, parse_size(v, name))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        """Raise :class:`ConfigError` for the first bad setting: counts, flags, hosts, choices,
        timeouts, the discovery address, the cluster token, in that order."""
        self._validate_counts()
        for name in ("disk_enabled", "metrics_enabled", "metrics_dashboard"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected true/false, got {getattr(self, name)!r}")
        self._validate_hosts()
        _check_transport(self.transport)
        if self.pool_policy not in ("lru",):
            raise ConfigError(f"pool_policy: expected 'lru', got {self.pool_policy!r}")
        for name in _TIMEOUT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name}: expected a positive number of seconds, got {v!r}")
        self._validate_discovery()
        self._validate_token()

    def _validate_counts(self) -> None:
        """The ports, counts and sizes: integers in range; the pool holds a page."""
        for name in ("rpc_port", "data_port", "metrics_port"):
            self._need_int(name, 0, 65535)
        self._need_int("max_masters", 1)
        self._need_int("virtual_nodes", 1, 100_000)
        self._need_int("directory_replicas", 1)
        self._need_int("max_channels_per_peer", 1, 4096)
        self._need_int("pool_size", 1)
        self._need_int("disk_size", 1)
        self._need_int("disk_queue_depth", 1)
        self._need_int("max_connections", 1)
        if self.page_size is not None:
            self._need_int("page_size", 1)
            # one slot = 64-byte header + page, rounded to 64 bytes (hiradix.peer.pool)
            if self.pool_size < self.page_size + 64:
                raise ConfigError(
                    f"pool_size: {self.pool_size} bytes cannot hold one page of page_size={self.page_size} bytes"
                )

    def _validate_hosts(self) -> None:
        """The node id, host names, advertised address and disk path."""
        self._need_str("node_id", optional=True)
        self._need_str("bind_host")
        self._need_str("advertise_addr", optional=True)
        if self.advertise_addr is not None and (
            self.advertise_addr in WILDCARD_HOSTS
            or not (_HOST_RE.match(self.advertise_addr) or is_ipv6(self.advertise_addr))
        ):
            raise ConfigError(
                f"advertise_addr: expected the host name or address other nodes dial (no port, "
                f"not a wildcard), got {self.advertise_addr!r}"
            )
        self._need_str("metrics_host", optional=True)
        self._need_str("disk_path")

    def _validate_discovery(self) -> None:
        """The discovery address: ``host:port``."""
        if self.discovery_addr is not None:
            host, sep, port = str(self.discovery_addr).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"discovery_addr: expected 'host:port', got {self.discovery_addr!r}")

    def _validate_token(self) -> None:
        """The cluster token: a non-empty string if given, and required (here or in
        ``$HIRADIX_CLUSTER_TOKEN``) when a listener is not on loopback."""
        if self.cluster_token is not None and (not isinstance(self.cluster_token, str) or not self.cluster_token):
            raise ConfigError("cluster_token: expected a non-empty string or null")
        exposed = [h for h in (self.bind_host, self.metrics_host) if h is not None and not is_loopback(h)]
        if exposed and self.cluster_token is None and not envvars.text(TOKEN_ENV):
            raise ConfigError(
                f"bind_host/metrics_host {exposed[0]!r} is not loopback and no cluster token is set: "
                f"set cluster_token or ${TOKEN_ENV}, or bind 127.0.0.1"
            )

    def _need_int(self, name: str, lo: int, hi: int | None = None) -> None:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}: expected an integer, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{name}: must be {bound}, got {v}")

    def _need_str(self, name: str, optional: bool = False) -> None:
        v = getattr(self, name)
        if v is None and optional:
            return
        if not isinstance(v, str) or not v.strip():
            raise ConfigError(f"{name}: expected a non-empty string, got {v!r}")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PeerConfig:
        """Build from a mapping (a ``"peer"`` sub-table is used if present).

        Unknown keys raise :class:`ConfigError` naming the closest known key.
        Sizes may be strings with units.
        """
        if "peer" in data and isinstance(data["peer"], Mapping):
            data = data["peer"]
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table of settings, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown setting {key!r}{hint}")
            if key in _SIZE_FIELDS and value is not None:
                value = parse_size(value, key)
            kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PeerConfig:
        """Load a ``.json`` or ``.toml`` file (TOML needs Python >= 3.11 or ``tomli``)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(p)!r}: {exc}") from exc
        suffix = p.suffix.lower()
        try:
            if suffix == ".json":
                data = json.loads(text)
            elif suffix == ".toml":
                if sys.version_info >= (3, 11):
                    import tomllib
                else:  # pragma: no cover - Python 3.10
                    import tomli as tomllib
                data = tomllib.loads(text)
            else:
                raise ConfigError(f"config file {str(p)!r}: expected a .json or .toml file")
        except (json.JSONDecodeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config file {str(p)!r} is not valid {suffix[1:].upper()}: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """All settings as a plain dict (``cluster_token`` included: handle with care)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> PeerConfig:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    def advertised_host(self) -> str:
        """The host other nodes dial: ``advertise_addr``, else :func:`default_advertise_host`
        of ``bind_host`` (:class:`ConfigError` when a wildcard bind gives none)."""
        return self.advertise_addr if self.advertise_addr is not None else default_advertise_host(self.bind_host)

    # ------------------------------------------------------------------ the parts' settings
    # Each part of a node takes the few settings it uses, not this whole object. (Imported
    # here, not at the top: loading a config file needs none of the parts.)
    def transport_settings(self) -> TransportSettings:
        """The data-plane transport's settings: ``bind_host:data_port``, the channel cap,
        ``read_timeout_s`` (a batch READ), ``connect_timeout_s`` (a handshake) and the
        listener's connection limits."""
        from hiradix.transport.base import TransportSettings

        return TransportSettings(
            host=self.bind_host,
            port=self.data_port,
            max_channels_per_peer=self.max_channels_per_peer,
            timeout=self.read_timeout_s,
            handshake_timeout=self.connect_timeout_s,
            max_connections=self.max_connections,
            idle_timeout=self.idle_timeout_s,
        )

    def transport_choice(self) -> TransportChoice:
        """What :func:`~hiradix.peer.transports.make_transport` builds for this node."""
        from hiradix.peer.transports import TransportChoice

        return TransportChoice(self.transport, self.transport_settings(), self.cluster_token)

    def producer_settings(self) -> ProducerSettings:
        """The published pools' and the disk tier's settings."""
        from hiradix.peer.producer import ProducerSettings

        return ProducerSettings(
            pool_size=self.pool_size,
            page_size=self.page_size,
            disk_enabled=self.disk_enabled,
            disk_path=self.disk_path,
            disk_size=self.disk_size,
            disk_queue_depth=self.disk_queue_depth,
        )

    def reader_settings(self, recv_bytes: int = 64 << 20, recv_lanes: int = 4) -> ReaderSettings:
        """The read paths' timeouts, with the receive region's size and lanes (the node's)."""
        from hiradix.peer.reader import ReaderSettings

        return ReaderSettings(self.read_timeout_s, self.promote_timeout_s, recv_bytes, recv_lanes)

    def sync_settings(self, heartbeat_s: float) -> SyncSettings:
        """The directory sync's settings, with the node's heartbeat period."""
        from hiradix.peer.sync import SyncSettings

        return SyncSettings(heartbeat_s, self.rpc_timeout_s, self.virtual_nodes, self.directory_replicas)

    @property
    def effective_metrics_host(self) -> str:
        """Where the metrics server binds."""
        return self.metrics_host if self.metrics_host is not None else self.bind_host

"""Which transport a peer node runs: the one place ``PeerConfig.transport`` is turned into
a :class:`~hiradix.transport.base.Transport`.

- ``"tcp"``: :class:`~hiradix.transport.tcp.TcpTransport` on ``bind_host:data_port``;
- ``"rdma"``: ``hiradix.transport.rdma.RdmaTransport`` (libibverbs), which needs an ACTIVE
  RDMA port; without one, :class:`TransportUnavailable` says why;
- ``"fake"``: :class:`~hiradix.transport.fake.FakeTransport` on the given
  :class:`~hiradix.transport.fake.FakeFabric` (in-process tests and the simulator);
- ``"auto"``: ``rdma`` where it can run, else ``tcp``, saying why in one INFO line. Given a
  fabric, ``auto`` means ``fake``.

>>> from hiradix.peer.config import PeerConfig
>>> from hiradix.transport.fake import FakeFabric
>>> t = make_transport(PeerConfig(metrics_enabled=False), "n1", FakeFabric())
>>> t.capabilities.kind, t.address
('fake', 'n1')
>>> t.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hiradix.net.auth import load_token
from hiradix.peer.config import TRANSPORTS, PeerConfig
from hiradix.transport.base import Transport, TransportUnavailable
from hiradix.transport.fake import FakeFabric, FakeTransport
from hiradix.transport.tcp import TcpTransport

__all__ = ["TransportUnavailable", "make_transport", "rdma_unavailable"]

# The choice is the peer node's: its log line goes where the node's own lines go.
log = logging.getLogger("hiradix.peer")


def rdma_unavailable() -> str | None:
    """Why the RDMA transport cannot run here, or ``None`` when it can: the reason of
    ``hiradix.transport.rdma`` (no ACTIVE port, no device...), or that the module does not
    import. Runtime complexity: ``O(devices)`` (a sysfs scan)."""
    try:
        from hiradix.transport.rdma import rdma_unavailable_reason
    except ImportError as exc:
        return f"the RDMA transport (hiradix.transport.rdma) does not import: {exc}"
    return rdma_unavailable_reason()


def _settings(cfg: PeerConfig) -> dict[str, Any]:
    # TCP's and RDMA's alike: the RDMA bootstrap (QP exchange) is an authenticated TCP listener.
    return {
        "host": cfg.bind_host,
        "port": cfg.data_port,
        "max_channels_per_peer": cfg.max_channels_per_peer,
        "timeout": cfg.read_timeout_s,
        "handshake_timeout": cfg.connect_timeout_s,
        "max_connections": cfg.max_connections,
        "idle_timeout": cfg.idle_timeout_s,
    }


def _tcp(cfg: PeerConfig, node_id: str, token: bytes | str | None) -> Transport:
    return TcpTransport(token, **_settings(cfg))


def _rdma(cfg: PeerConfig, node_id: str, token: bytes | str | None) -> Transport:
    why = rdma_unavailable()
    if why is not None:
        raise TransportUnavailable(f"transport 'rdma' cannot run here: {why}; use transport 'tcp' or 'auto'")
    from hiradix.transport.rdma import RdmaTransport

    transport: Transport = RdmaTransport(token, **_settings(cfg))
    return transport


def _auto(cfg: PeerConfig, node_id: str, token: bytes | str | None) -> Transport:
    why = rdma_unavailable()
    if why is None:
        return _rdma(cfg, node_id, token)
    log.info("%s: transport 'auto' runs over TCP: %s", node_id, why)
    return _tcp(cfg, node_id, token)


_BUILDERS: dict[str, Callable[[PeerConfig, str, bytes | str | None], Transport]] = {
    "tcp": _tcp,
    "rdma": _rdma,
    "auto": _auto,
}


def make_transport(
    cfg: PeerConfig, node_id: str, fabric: FakeFabric | None = None, *, token: bytes | str | None = None
) -> Transport:
    """The transport ``cfg.transport`` names, for node ``node_id`` (module docstring).

    ``fabric`` puts the node on an in-process fake NIC: it goes with ``"fake"`` or
    ``"auto"``, and ``"fake"`` needs it. ``token`` is the cluster token (default:
    ``cfg.cluster_token``, else ``$HIRADIX_CLUSTER_TOKEN``). Raises
    :class:`TransportUnavailable` when the choice cannot run here, ``OSError`` when a
    listener cannot bind. Runtime complexity: ``O(1)`` plus the transport's start.
    """
    kind = cfg.transport
    if fabric is not None or kind == "fake":
        if fabric is None:
            raise TransportUnavailable(
                "transport 'fake' is the in-process fake NIC and needs a FakeFabric "
                "(PeerNode(fabric=...) or InProcessCluster(transport='fake'))"
            )
        if kind not in ("fake", "auto"):
            raise TransportUnavailable(f"a fake fabric was given but transport is {kind!r}: use 'fake' or 'auto'")
        return FakeTransport(
            fabric, node_id, max_channels_per_peer=cfg.max_channels_per_peer, timeout=cfg.read_timeout_s
        )
    if kind not in _BUILDERS:  # PeerConfig validates it; a hand-made config may not have
        raise TransportUnavailable(f"transport: expected one of {', '.join(map(repr, TRANSPORTS))}, got {kind!r}")
    return _BUILDERS[kind](cfg, node_id, load_token(cfg.cluster_token) if token is None else token)

"""Which transport a peer node runs: the one place a node's transport choice
(:class:`TransportChoice`, :meth:`PeerConfig.transport_choice
<hiradix.peer.config.PeerConfig.transport_choice>`) is turned into a
:class:`~hiradix.transport.base.Transport`.

- ``"tcp"``: :class:`~hiradix.transport.tcp.TcpTransport` on ``bind_host:data_port``;
- ``"rdma"``: ``hiradix.transport.rdma.RdmaTransport`` (libibverbs), which needs an ACTIVE
  RDMA port; without one, :class:`TransportUnavailable` says why;
- ``"fake"``: :class:`~hiradix.transport.fake.FakeTransport` on the given
  :class:`~hiradix.transport.fake.FakeFabric` (in-process tests and the simulator);
- ``"auto"``: ``rdma`` where it can run, else ``tcp``, saying why in one INFO line. Given a
  fabric, ``auto`` means ``fake``.

>>> from hiradix.transport.fake import FakeFabric
>>> t = make_transport(TransportChoice("fake"), "n1", FakeFabric())
>>> t.capabilities.kind, t.address
('fake', 'n1')
>>> t.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hiradix.net.auth import load_token
from hiradix.transport.base import Transport, TransportSettings, TransportUnavailable
from hiradix.transport.fake import FakeFabric, FakeTransport
from hiradix.transport.tcp import TcpTransport

__all__ = ["TRANSPORTS", "TransportChoice", "TransportUnavailable", "make_transport", "rdma_unavailable"]

#: The data-plane transports a node can run (:func:`make_transport`; :class:`PeerConfig
#: <hiradix.peer.config.PeerConfig>` checks its ``transport`` against them).
TRANSPORTS = ("auto", "tcp", "rdma", "fake")

# The choice is the peer node's: its log line goes where the node's own lines go.
log = logging.getLogger("hiradix.peer")


@dataclass(frozen=True)
class TransportChoice:
    """What :func:`make_transport` builds: the kind (one of :data:`TRANSPORTS`), the
    transport's settings, and the cluster token (``None``: ``$HIRADIX_CLUSTER_TOKEN``;
    never shown by ``repr``)."""

    kind: str = "auto"
    settings: TransportSettings = field(default_factory=TransportSettings)
    cluster_token: str | None = field(default=None, repr=False)


def rdma_unavailable() -> str | None:
    """Why the RDMA transport cannot run here, or ``None`` when it can: the reason of
    ``hiradix.transport.rdma`` (no ACTIVE port, no device...), or that the module does not
    import. Runtime complexity: ``O(devices)`` (a sysfs scan)."""
    try:
        from hiradix.transport.rdma import rdma_unavailable_reason
    except ImportError as exc:
        return f"the RDMA transport (hiradix.transport.rdma) does not import: {exc}"
    return rdma_unavailable_reason()


# TCP's and RDMA's settings alike: the RDMA bootstrap (QP exchange) is an authenticated TCP listener.
def _tcp(settings: TransportSettings, node_id: str, token: bytes | str | None) -> Transport:
    return TcpTransport(token, **settings.socket_kwargs())


def _rdma(settings: TransportSettings, node_id: str, token: bytes | str | None) -> Transport:
    why = rdma_unavailable()
    if why is not None:
        raise TransportUnavailable(f"transport 'rdma' cannot run here: {why}; use transport 'tcp' or 'auto'")
    from hiradix.transport.rdma import RdmaTransport

    transport: Transport = RdmaTransport(token, **settings.socket_kwargs())
    return transport


def _auto(settings: TransportSettings, node_id: str, token: bytes | str | None) -> Transport:
    why = rdma_unavailable()
    if why is None:
        return _rdma(settings, node_id, token)
    log.info("%s: transport 'auto' runs over TCP: %s", node_id, why)
    return _tcp(settings, node_id, token)


_BUILDERS: dict[str, Callable[[TransportSettings, str, bytes | str | None], Transport]] = {
    "tcp": _tcp,
    "rdma": _rdma,
    "auto": _auto,
}


def make_transport(
    choice: TransportChoice, node_id: str, fabric: FakeFabric | None = None, *, token: bytes | str | None = None
) -> Transport:
    """The transport ``choice.kind`` names, for node ``node_id`` (module docstring).

    ``fabric`` puts the node on an in-process fake NIC: it goes with ``"fake"`` or
    ``"auto"``, and ``"fake"`` needs it. ``token`` is the cluster token (default:
    ``choice.cluster_token``, else ``$HIRADIX_CLUSTER_TOKEN``). Raises
    :class:`TransportUnavailable` when the choice cannot run here, ``OSError`` when a
    listener cannot bind. Runtime complexity: ``O(1)`` plus the transport's start.
    """
    kind = choice.kind
    if fabric is not None or kind == "fake":
        if fabric is None:
            raise TransportUnavailable(
                "transport 'fake' is the in-process fake NIC and needs a FakeFabric "
                "(PeerNode(fabric=...) or InProcessCluster(transport='fake'))"
            )
        if kind not in ("fake", "auto"):
            raise TransportUnavailable(f"a fake fabric was given but transport is {kind!r}: use 'fake' or 'auto'")
        return FakeTransport(fabric, node_id, **choice.settings.channel_kwargs())
    if kind not in _BUILDERS:  # PeerConfig validates it; a hand-made choice may not have
        raise TransportUnavailable(f"transport: expected one of {', '.join(map(repr, TRANSPORTS))}, got {kind!r}")
    return _BUILDERS[kind](choice.settings, node_id, load_token(choice.cluster_token) if token is None else token)

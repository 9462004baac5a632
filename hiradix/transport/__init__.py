"""Transports: register host memory, read peers' registered memory in batches.

:class:`~hiradix.transport.base.Transport` is the seam; :class:`TcpTransport` runs
everywhere, :class:`FakeTransport` is an in-process fake NIC for tests;
:func:`hiradix.peer.transports.make_transport` builds the one a peer node's config names.
"""

from hiradix.net.auth import AuthError, load_token
from hiradix.transport.base import (
    Capabilities,
    InjectedFault,
    ReadOp,
    Region,
    RegionBusyError,
    Status,
    Transport,
    TransportError,
    TransportSettings,
    TransportStats,
    TransportUnavailable,
)
from hiradix.transport.fake import FakeClock, FakeFabric, FakeTransport
from hiradix.transport.tcp import TcpTransport

__all__ = [
    "AuthError",
    "Capabilities",
    "FakeClock",
    "FakeFabric",
    "FakeTransport",
    "InjectedFault",
    "ReadOp",
    "Region",
    "RegionBusyError",
    "Status",
    "TcpTransport",
    "Transport",
    "TransportError",
    "TransportSettings",
    "TransportStats",
    "TransportUnavailable",
    "load_token",
]

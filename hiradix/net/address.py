"""Addresses of peers: ``host:port`` parsing, the host other nodes should dial, loopback.

Shared by the RPC control plane (:mod:`hiradix.net.rpc`), the transports, the peer cache and
the Mooncake backend, so it sits at the bottom of the networking layers.
"""

from __future__ import annotations

import ipaddress
import socket

from hiradix.settings import ConfigError

__all__ = ["WILDCARD_HOSTS", "default_advertise_host", "is_ipv6", "is_loopback", "parse_peer", "with_host"]

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})  # binds that listen on every interface
# Where route lookups aim: TEST-NET addresses (RFC 5737 / RFC 3849). Connecting a UDP socket
# sends nothing; the kernel only picks the route and with it the source address.
_ROUTE_PROBES = {socket.AF_INET: "192.0.2.1", socket.AF_INET6: "2001:db8::1"}


def parse_peer(peer: str | tuple[str, int]) -> tuple[str, int]:
    """Split ``"host:port"`` (or pass a ``(host, port)`` tuple through), checking the port.

    >>> parse_peer("127.0.0.1:9000")
    ('127.0.0.1', 9000)
    """
    if isinstance(peer, tuple):
        host, port = peer
    elif isinstance(peer, str):
        host, sep, port_s = peer.rpartition(":")
        if not sep or not host:
            raise ValueError(f"peer must be 'host:port', got {peer!r}")
        try:
            port = int(port_s)
        except ValueError:
            raise ValueError(f"peer port is not an integer: {peer!r}") from None
    else:
        raise TypeError(f"peer must be 'host:port' or (host, port), got {type(peer).__name__}")
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"bad peer address {peer!r}")
    return host, port


def with_host(addr: str, host: str) -> str:
    """``addr`` (``host:port``) with its host replaced: what peers are told to dial.

    >>> with_host("0.0.0.0:7000", "10.0.0.5"), with_host("0.0.0.0:7000", "fe80::1")
    ('10.0.0.5:7000', '[fe80::1]:7000')
    """
    _, port = parse_peer(addr)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address (not a name). ``O(1)``."""
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback. ``O(1)``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route_source(family: socket.AddressFamily) -> str | None:
    """The source address the kernel would use towards the default route, or ``None``."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((_ROUTE_PROBES[family], 9))
            addr = str(s.getsockname()[0])
    except OSError:  # no route (no default route, or the family is off)
        return None
    ip = ipaddress.ip_address(addr.split("%")[0])
    return None if ip.is_unspecified or ip.is_loopback else addr


def default_advertise_host(bind_host: str) -> str:
    """The address other nodes should dial for a node bound to ``bind_host``.

    A specific address is its own answer. For a wildcard bind (``0.0.0.0``, ``::``) it is the
    address of the interface the default route leaves by, else what the hostname resolves to,
    never a wildcard or (when other hosts are meant to reach it) a loopback address;
    :class:`ConfigError` when neither gives one (set ``advertise_addr``).
    Runtime complexity: ``O(1)`` (one route lookup, maybe one name lookup).

    >>> default_advertise_host("127.0.0.1")
    '127.0.0.1'
    """
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    family = socket.AF_INET6 if bind_host == "::" else socket.AF_INET
    found = _route_source(family)
    if found is None:
        try:
            infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
        except OSError:
            infos = []
        addrs = [str(i[4][0]) for i in infos]
        found = next((a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback), None)
    if found is None:
        raise ConfigError(
            f"bind_host {bind_host!r} listens on every interface and no address to advertise was found "
            "(no default route, and the hostname resolves to loopback only): set advertise_addr (--advertise-addr)"
        )
    return found

"""Ports for processes that are restarted on the port they had (tests, the fault harness).

A port found free by binding port 0 comes from the kernel's ephemeral range, the range the
kernel also hands to every other ``bind(0)`` and outgoing connection: between the check
and the real bind, or while a node is down after ``kill -9``, another process can be given
it (one CI run with two suites at once lost a rendezvous port that way).
:func:`reusable_port` picks a free port *below* that range, which the kernel never hands
out on its own: only another explicit choice of the same number could take it, one in
about twenty thousand.
"""

from __future__ import annotations

import random
import socket

__all__ = ["reusable_port"]

_LOW = 10000  # below the registered services that test machines commonly run


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def reusable_port(host: str = "127.0.0.1", *, tries: int = 200) -> int:
    """A TCP port on ``host``, below the ephemeral range, that nothing listens on now.
    ``OSError`` if ``tries`` random candidates were all taken. ``O(tries)`` binds."""
    high = _ephemeral_low()
    low = _LOW if high > _LOW + 1000 else 1024
    rng = random.SystemRandom()
    for _ in range(tries):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in [{low}, {high}) on {host} after {tries} tries")

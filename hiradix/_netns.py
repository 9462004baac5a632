"""Run a command in a network namespace of its own: a new namespace (Linux
``unshare(CLONE_NEWNET)``, root or ``CAP_SYS_ADMIN``) whose only interface is its
loopback, brought up. A server in there that binds ``0.0.0.0`` (Mooncake's transfer
engine does, with no option to bind elsewhere) listens on that private loopback and on
nothing else. Used by the Mooncake tests and benchmark::

    python -m hiradix._netns python -m pytest tests/storage/mooncake_suite.py

Exits with :data:`NO_NETNS` (and says why on stderr) when the namespace cannot be made.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["NO_NETNS", "enter_private_netns", "run_in_private_netns"]

NO_NETNS = 97  # exit status: the namespace could not be made (nothing was run)
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: the name, then ifr_flags in the 24-byte union


def enter_private_netns() -> None:
    """Move this (single-threaded) process into a new network namespace and bring its
    loopback up. ``OSError`` (with the errno) when the kernel refuses. ``O(1)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        flags = struct.unpack(_IFREQ, got)[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def run_in_private_netns(
    argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a network namespace of its own (module docstring); its output is
    captured as text. Status :data:`NO_NETNS` when the namespace could not be made.
    ``subprocess.TimeoutExpired`` past ``timeout`` seconds (the child is killed)."""
    cmd = [sys.executable, "-m", "hiradix._netns", *argv]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=None if env is None else dict(env), cwd=cwd
    )


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m hiradix._netns COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        enter_private_netns()
    except OSError as exc:
        print(f"hiradix._netns: cannot make a network namespace: {exc}", file=sys.stderr)
        return NO_NETNS
    os.execvp(argv[0], list(argv))
    return 0  # not reached: execvp replaces the process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

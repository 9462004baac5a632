"""hiradix._ports: restartable ports come from below the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from hiradix._ports import _ephemeral_low, reusable_port


def test_a_reusable_port_is_free_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        port = reusable_port()
        assert port < low
        socket.create_server(("127.0.0.1", port)).close()  # nothing listens there


def test_the_ephemeral_range_is_read_from_proc_or_defaults(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert _ephemeral_low(str(f)) == 40000
    f.write_text("garbage")
    assert _ephemeral_low(str(f)) == 32768
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768

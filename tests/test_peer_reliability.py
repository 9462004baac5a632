"""Peer-node reliability (issue 16): republish never makes a reader miss, the receive region
is not remotely readable, one bad directory entry is one miss, and a node that fails to
start says which port and leaves nothing open. Loopback only; no test sleeps."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from hiradix.peer.node import InProcessCluster
from hiradix.transport.base import Status

PAGE = 4096


def key(i: int, tag: str = "") -> str:
    return hashlib.sha256(f"rel{tag}{i}".encode()).hexdigest()


def page(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(params=["fake", "tcp"])
def cluster(request: pytest.FixtureRequest) -> Any:
    c = InProcessCluster(2, transport=request.param, pool_size=64 * (PAGE + 64), read_timeout_s=5.0)
    yield c
    c.close()


# ---------------------------------------------------------------------- receive region
def test_receive_region_is_not_remotely_readable(cluster: InProcessCluster) -> None:
    """A peer presenting the receive region's rkey (at its exact address) gets BAD_RKEY;
    the published pool of the same node stays readable."""
    a, b = cluster.nodes
    assert a.publish_many([key(0)], [page(0)]) == [True]
    sink = np.zeros(PAGE, dtype=np.uint8)
    b.transport.register(sink, remote=False)
    recv = a.recv.region
    ops = [(recv.addr, recv.rkey, 64, sink.ctypes.data)]
    assert b.transport.read_batch(a.transport.address, ops) == [Status.BAD_RKEY]
    entry = b.lookup([key(0)])[0]
    assert entry is not None
    ok = [(entry.addr, entry.rkey, 64, sink.ctypes.data)]
    assert b.transport.read_batch(a.transport.address, ok) == [Status.OK]


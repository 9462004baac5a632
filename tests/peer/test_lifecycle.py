"""Node lifecycle in one process: remembered peers and probing (injected clock), membership
logs, incarnations across a restart on the same address, verified joins and readiness.
Real RPC on 127.0.0.1 where a node is involved; no test sleeps."""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest

from hiradix._ports import reusable_port
from hiradix.net.rpc import RpcClient, RpcServer
from hiradix.peer.config import PeerConfig
from hiradix.peer.membership import JoinError, Membership, NodeInfo, describe_failure
from hiradix.peer.node import InProcessCluster, PeerNode
from hiradix.peer.ring import HashRing
from hiradix.transport.fake import FakeClock

pytestmark = pytest.mark.slow  # peer nodes joining, leaving and restarting

PAGE = 4096


def key(i: int, tag: str = "") -> str:
    return hashlib.sha256(f"life{tag}{i}".encode()).hexdigest()


def page(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


# ---------------------------------------------------------------------- membership, fake clock
class _Net:
    """In-process discovery wiring: call(addr, method, args) -> the target's handler."""

    def __init__(self) -> None:
        self.nodes: dict[str, Membership] = {}
        self.down: set[str] = set()
        self.calls: dict[str, int] = {}

    def call(self, addr: str, method: str, args: list[Any]) -> Any:
        self.calls[addr] = self.calls.get(addr, 0) + 1
        if addr in self.down or addr not in self.nodes:
            raise ConnectionRefusedError(f"{addr} is down")
        return self.nodes[addr].handle(method, args)

    def add(self, name: str, clock: FakeClock, incarnation: int = 1, **kw: Any) -> Membership:
        m = Membership(NodeInfo(name, name, f"data-{name}", None, incarnation), self.call, ttl=3.0, clock=clock, **kw)
        self.nodes[name] = m
        self.down.discard(name)
        return m


def rounds(net: _Net, clock: FakeClock, n: int = 2) -> None:
    for _ in range(n):
        clock.advance(1.0)
        for name, m in list(net.nodes.items()):
            if name not in net.down:
                m.tick()
                m.probe()


def test_members_find_a_head_restarted_without_seeds() -> None:
    clock, net = FakeClock(), _Net()
    net.add("h", clock, head="h")
    a, b = net.add("a", clock, head="h"), net.add("b", clock, head="h")
    assert a.join() and b.join()
    rounds(net, clock)
    # The head dies and stays dead long enough to expire everywhere.
    net.down.add("h")
    rounds(net, clock, 6)
    assert set(a.members()) == set(b.members()) == {"a", "b"}
    # Restarted with the command it was first started with: no seeds, alone, a new run.
    h2 = net.add("h", clock, incarnation=2, head="h")
    assert h2.join() and set(h2.members()) == {"h"}
    # The members remember its address and probe it (backoff at most 5 s): it is found.
    rounds(net, clock, 8)
    for m in (h2, a, b):
        assert set(m.members()) == {"h", "a", "b"}
    assert a.info("h") == NodeInfo("h", "h", "data-h", None, 2)
    assert a.masters()[0] == "h"


def test_probe_backoff_is_bounded_and_dead_addresses_are_forgotten() -> None:
    clock, net = FakeClock(), _Net()
    m = net.add("a", clock, seeds=("seed",), backoff=(1.0, 4.0), forget_after=60.0)
    assert not m.join()  # the seed is down
    assert net.add("x", clock, seeds=("a",)).join()  # x joins through a, then dies
    assert m.remembered() == {"seed": None, "x": "x"}
    net.down.add("x")
    clock.advance(10.0)
    m.tick()  # x expires
    assert "x" not in m.members()
    net.calls.clear()
    probes_at: list[float] = []
    for _ in range(120):  # two minutes, one probe round a second
        before = net.calls.get("x", 0)
        m.probe()
        if net.calls.get("x", 0) > before:
            probes_at.append(clock())
        clock.advance(1.0)
    gaps = np.diff(probes_at)
    assert gaps.max() <= 4.0 and list(gaps[:3]) == [1.0, 2.0, 4.0]  # doubling, then bounded
    assert "x" not in m.remembered() and probes_at[-1] < clock() - 30  # forgotten after 60 s
    assert "seed" in m.remembered() and net.calls["seed"] >= 20  # a seed is never forgotten


def test_membership_changes_are_logged_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    clock, net = FakeClock(), _Net()
    h = net.add("h", clock, head="h")
    a, b = net.add("a", clock, head="h"), net.add("b", clock, head="h")
    caplog.set_level(logging.INFO, logger="hiradix.peer.membership")
    a.join()
    b.join()
    rounds(net, clock)
    b.leave()
    net.down.add("b")
    net.down.add("a")
    rounds(net, clock, 5)  # a expires at h
    net.add("a", clock, incarnation=7, head="h").join()  # a comes back as a new run
    lines = [r.getMessage() for r in caplog.records if r.name == "hiradix.peer.membership"]
    assert "h: member joined: a (rpc a, incarnation 1)" in lines
    assert "h: member left: b" in lines
    assert "h: member expired: a (nothing heard for 3.0s)" in lines
    assert "h: member joined: a (rpc a, incarnation 7)" in lines
    # A restart seen before expiry is reported as such.
    caplog.clear()
    net.add("a", clock, incarnation=8, head="h").join()
    assert "h: member restarted: a (incarnation 7 -> 8)" in [r.getMessage() for r in caplog.records]
    assert set(h.members()) == {"h", "a"}


def test_a_master_that_never_answers_does_not_delay_the_heartbeats_to_the_others() -> None:
    """The head is a listener that accepts connections and never says a word (a stopped
    process). Each round ``z`` heartbeats it and the live master ``m``: every tick returns
    while the call to the head still hangs, with ``m`` answered, so ``z`` stays live at ``m``
    round after round, and the head gets one call in flight, not one per round. (The masters
    used to be called one after another, head first: each round waited out the head's whole
    RPC timeout, longer than the TTL, before ``m`` heard from ``z``.)"""
    clock = FakeClock()
    with socket.create_server(("127.0.0.1", 0)) as silent, RpcClient(secrets.token_hex(16), timeout=5.0) as client:
        hung = f"127.0.0.1:{silent.getsockname()[1]}"
        nodes: dict[str, Membership] = {}
        state = threading.Condition()
        hanging, sent = [0], [0]

        def call(addr: str, method: str, args: list[Any]) -> Any:
            if addr != hung:
                return nodes[addr].handle(method, args)
            with state:
                hanging[0] += 1
                sent[0] += 1
            try:
                return client.call(addr, method, *args)
            finally:
                with state:
                    hanging[0] -= 1
                    state.notify_all()

        for name in ("m", "z"):
            me = NodeInfo(name, name, f"data-{name}")
            nodes[name] = Membership(me, call, head=hung, max_masters=2, ttl=3.0, clock=clock, heartbeat_timeout=0.05)
            nodes[name].handle("disc_join", [NodeInfo("h", hung, "data-h").to_wire()])
        m, z = nodes["m"], nodes["z"]
        m.handle("disc_join", [z.me.to_wire()])
        z.handle("disc_join", [m.me.to_wire()])
        assert z.masters() == ("h", "m") and set(m.members()) == set(z.members()) == {"h", "m", "z"}
        for _ in range(3):  # within the TTL of the head's last sign of life
            clock.advance(1.0)
            z.tick()
            with state:
                assert hanging[0] >= 1, "the tick waited for the silent master"
            m.tick()
            assert set(m.members()) == {"h", "m", "z"} and not z.frozen
        assert sent[0] == 2  # one call each from z and m, still in flight
        for _ in range(2):  # the head expires everywhere; z and m never do
            clock.advance(1.0)
            z.tick()
            m.tick()
        assert set(m.members()) == set(z.members()) == {"m", "z"} and z.masters() == ("m", "z")
        assert z.heartbeat_failures == 0  # the calls to the head have not even timed out yet
    with state:  # the listener is closed: its queued connections are reset, the calls end
        assert state.wait_for(lambda: hanging[0] == 0, timeout=30)


def test_a_silent_peer_is_reported_as_a_timeout_and_a_wrong_token_as_a_refusal() -> None:
    """A peer that accepts connections and never completes the handshake timed out (it
    used to be reported as having refused the cluster token: the handshake's timeout is an
    AuthError); a peer holding another token refused it."""
    with (
        socket.create_server(("127.0.0.1", 0)) as silent,
        RpcServer(secrets.token_hex(16)) as foreign,
        RpcClient(secrets.token_hex(16), timeout=0.3) as client,
    ):
        silent_addr = f"127.0.0.1:{silent.getsockname()[1]}"
        for addr, refused, words in (
            (silent_addr, False, f"RpcTimeout: {silent_addr} accepted the connection but did not complete"),
            (foreign.address, True, "the cluster token was refused"),
        ):
            with pytest.raises(OSError) as info:
                client.call(addr, "disc_view")
            reason, auth = describe_failure(info.value)
            assert auth is refused and reason.startswith(words), reason


def test_join_through_a_silent_seed_retries_and_says_it_timed_out(caplog: pytest.LogCaptureFixture) -> None:
    """A seed that never completes the handshake is retried until the join timeout (a
    refusal stops at once), then named as timed out, and never logged as a refusal."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        seed = f"127.0.0.1:{silent.getsockname()[1]}"
        cfg = PeerConfig(
            metrics_enabled=False,
            cluster_token=secrets.token_hex(16),
            join_timeout_s=0.6,
            rpc_timeout_s=0.15,
            connect_timeout_s=0.15,
        )
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        with pytest.raises(JoinError, match=f"{seed}: RpcTimeout: .*did not complete the handshake") as info:
            PeerNode(cfg, seeds=[seed], heartbeat_s=0.1)
        assert time.monotonic() - t0 >= cfg.join_timeout_s  # it kept trying
        assert "refused" not in str(info.value)
        assert not [r for r in caplog.records if "refused" in r.getMessage()]


# ---------------------------------------------------------------------- nodes over real RPC
def test_join_fails_clearly_when_no_seed_answers() -> None:
    dead = f"127.0.0.1:{reusable_port()}"
    cfg = PeerConfig(metrics_enabled=False, cluster_token=secrets.token_hex(16), join_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(JoinError, match=f"cannot join the cluster through {dead}: {dead}: .*refused"):
        PeerNode(cfg, seeds=[dead], heartbeat_s=0.1)
    assert time.monotonic() - t0 < 10.0


def test_join_fails_at_once_on_a_wrong_token(caplog: pytest.LogCaptureFixture) -> None:
    with PeerNode(PeerConfig(metrics_enabled=False, cluster_token=secrets.token_hex(16)), heartbeat_s=0.2) as head:
        cfg = PeerConfig(metrics_enabled=False, cluster_token=secrets.token_hex(16), discovery_addr=head.address)
        caplog.set_level(logging.WARNING)
        t0 = time.monotonic()
        with pytest.raises(JoinError, match="cluster token was refused"):
            PeerNode(cfg, heartbeat_s=0.2)  # join_timeout_s is 30 s: a refusal does not wait it out
        assert time.monotonic() - t0 < 15.0
        assert any("cluster token was refused" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert list(head.membership.members()) == [head.node_id]


def test_allow_alone_starts_alone_loudly_and_not_ready(caplog: pytest.LogCaptureFixture) -> None:
    dead = f"127.0.0.1:{reusable_port()}"
    cfg = PeerConfig(metrics_enabled=False, cluster_token=secrets.token_hex(16), join_timeout_s=0.3)
    caplog.set_level(logging.WARNING)
    with PeerNode(cfg, seeds=[dead], heartbeat_s=0.1, allow_alone=True) as node:
        assert any("running ALONE" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert not node.is_ready() and node.status()["ready"] is False
        assert dead in node.membership.remembered()  # and it keeps probing the seed


def test_a_member_that_never_answers_does_not_hold_up_the_heartbeats() -> None:
    """Member ``x`` joins through the head, then accepts connections and never says a
    word (a stopped process). The node learns of it from a heartbeat and re-publishes to
    it the keys it gained: that ``dir_put`` hangs (for the whole RPC timeout, far longer
    than the TTL), and all the while the node goes on heartbeating the head, a beat
    every round. (The re-publish used to run on the heartbeat thread: the node's
    heartbeats stopped for the RPC timeout, and the healthy masters expired it; and its
    status waited for the re-publish to end.) The clocks are fake so nobody expires; the
    gaps between beats are real seconds."""
    clock, ttl = FakeClock(), 2.0
    base = dict(metrics_enabled=False, cluster_token=secrets.token_hex(16), pool_size=64 * (PAGE + 64), max_masters=1)
    state = threading.Condition()
    beats: list[tuple[str, float]] = []  # (sender, when the head heard it)
    in_flight: dict[str, int] = {}  # the node's calls to x still waiting, by method
    with socket.create_server(("127.0.0.1", 0)) as silent:
        hung = f"127.0.0.1:{silent.getsockname()[1]}"
        head = PeerNode(PeerConfig(**base), start=False, heartbeat_s=3600.0, clock=clock)
        node: PeerNode | None = None
        try:

            def heard(*args: Any) -> Any:
                with state:
                    beats.append((args[0][0], time.monotonic()))
                    state.notify_all()
                return head.membership.handle("disc_heartbeat", list(args))

            head.rpc.register("disc_heartbeat", heard)
            cfg = PeerConfig(**dict(base, discovery_addr=head.address, rpc_timeout_s=30.0))
            node = PeerNode(cfg, heartbeat_s=0.05, ttl_s=ttl, clock=clock)
            assert node.is_ready()
            keys = [key(i, "hung") for i in range(64)]
            assert all(node.publish_many(keys, [page(i, 64) for i in range(64)]))
            real = node.client.call

            def call(peer: str, method: str, *args: Any, **kw: Any) -> Any:
                if peer != hung:
                    return real(peer, method, *args, **kw)
                with state:
                    in_flight[method] = in_flight.get(method, 0) + 1
                    state.notify_all()
                try:
                    return real(peer, method, *args, **kw)
                finally:
                    with state:
                        in_flight[method] -= 1
                        state.notify_all()

            node.client.call = call  # type: ignore[method-assign]
            head.membership.handle("disc_join", [NodeInfo("x", hung, hung).to_wire()])
            me = node.node_id
            with state:
                assert state.wait_for(lambda: in_flight.get("dir_put", 0) > 0, timeout=20), "no re-publish to x"
                t0 = time.monotonic()
                assert state.wait_for(lambda: sum(n == me and t > t0 for n, t in beats) >= 5, timeout=10), (
                    "the heartbeats waited for the re-publish to the silent member"
                )
                gaps = np.diff([t0] + [t for n, t in beats if n == me and t > t0])
            status = node.status()  # no wait either: readiness is not behind the re-publish
            with state:
                assert in_flight["dir_put"] > 0  # all of that while the re-publish hangs
            assert gaps.max() < ttl
            assert set(head.membership.members()) == set(status["members"]) == {head.node_id, me, "x"}
            assert status["ready"] and status["background_errors"] == {}
        finally:
            silent.close()  # its queued connections are reset: the calls to x end
            if node is not None:
                node.close(leave=False)
            head.close(leave=False)


def test_a_member_that_never_answers_does_not_hold_up_the_republish_to_the_others() -> None:
    """Member ``x`` joins and never says a word; the node's re-publish to it hangs for the
    whole RPC timeout (30 s). Then ``y`` joins: the node re-publishes to ``y`` the keys it
    gained within seconds, while the call to ``x`` is still hanging. (The sync thread used
    to call the owners one after another and wait for each: ``y`` got nothing until ``x``
    timed out, and every later change waited behind it.) Clocks are fake so nobody
    expires; the waits are bounded real seconds."""
    clock = FakeClock()
    base = dict(metrics_enabled=False, cluster_token=secrets.token_hex(16), pool_size=64 * (PAGE + 64), max_masters=1)
    state = threading.Condition()
    begun: list[str] = []  # the node's calls to x, by method
    with socket.create_server(("127.0.0.1", 0)) as silent:
        hung = f"127.0.0.1:{silent.getsockname()[1]}"
        head = PeerNode(PeerConfig(**base), start=False, heartbeat_s=3600.0, clock=clock)
        other = PeerNode(PeerConfig(**base), start=False, heartbeat_s=3600.0, clock=clock)
        node: PeerNode | None = None
        try:
            cfg = PeerConfig(**dict(base, discovery_addr=head.address, rpc_timeout_s=30.0))
            node = PeerNode(cfg, heartbeat_s=0.05, ttl_s=2.0, clock=clock)
            keys = [key(i, "fan") for i in range(64)]
            assert all(node.publish_many(keys, [page(i, 64) for i in range(64)]))
            real = node.client.call

            def call(peer: str, method: str, *args: Any, **kw: Any) -> Any:
                if peer == hung:
                    with state:
                        begun.append(method)
                        state.notify_all()
                return real(peer, method, *args, **kw)

            node.client.call = call  # type: ignore[method-assign]

            def put_at_y(items: list[Any]) -> Any:
                with state:
                    try:
                        return other.shard.dispatch("dir_put", items)
                    finally:
                        state.notify_all()

            other.rpc.register("dir_put", put_at_y)
            head.membership.handle("disc_join", [NodeInfo("x", hung, hung).to_wire()])
            with state:
                assert state.wait_for(lambda: "dir_put" in begun, timeout=20), "no re-publish to x"
            t0 = time.monotonic()
            head.membership.handle("disc_join", [other.membership.me.to_wire()])
            ring = HashRing([head.node_id, node.node_id, "x", other.node_id], vnodes=cfg.virtual_nodes)
            gained = [k for k in keys if other.node_id in ring.owners(k, cfg.directory_replicas)]
            assert gained, "y owns none of the keys: pick more keys"
            with state:
                assert state.wait_for(lambda: all(other.shard.get(k) for k in gained), timeout=10), (
                    "y got nothing while the call to x hung"
                )
            elapsed = time.monotonic() - t0
            assert elapsed < 10.0 < cfg.rpc_timeout_s  # so the call to x is still hanging
            assert set(node.directory.ring.nodes) == {head.node_id, node.node_id, "x", other.node_id}
            assert node.status()["background_errors"] == {}
        finally:
            silent.close()  # its queued connections are reset: the calls to x end
            if node is not None:
                node.close(leave=False)
            other.close(leave=False)
            head.close(leave=False)


def test_a_joining_node_is_ready_with_its_share_of_the_directory() -> None:
    with InProcessCluster(2, pool_size=64 * (PAGE + 64)) as cluster:
        producer = cluster.nodes[1]  # not the head: nothing re-publishes its pages synchronously
        keys = [key(i) for i in range(60)]
        assert all(producer.publish_many(keys, [page(i) for i in range(60)]))
        cfg = PeerConfig(**dict(cluster.config, discovery_addr=cluster.nodes[0].address))
        late = PeerNode(cfg, start=False, heartbeat_s=3600.0)
        cluster.nodes.append(late)
        assert not late.is_ready() and late.status()["ready"] is False  # it has seeds, has not joined
        assert late.join()  # no heartbeat round anywhere: the producer has not seen it yet
        assert late.is_ready() and late.status()["ready"] is True
        owned = [k for k in keys if late.node_id in late.directory.ring.owners(k, 2)]
        assert owned and all(late.shard.get(k) is not None for k in owned)
        bufs = [bytearray(PAGE) for _ in keys]
        assert all(late.read_into(keys, [memoryview(b) for b in bufs]))
        assert [bytes(b) for b in bufs] == [page(i) for i in range(60)]


def test_a_node_restarted_on_its_address_replaces_its_earlier_run() -> None:
    with InProcessCluster(3, pool_size=256 * (PAGE + 64)) as cluster:
        a, old, c = cluster.nodes
        keys = [key(i, "r") for i in range(60)]
        for rnd in range(3):  # the first run's generations climb to 180
            assert all(old.publish_many(keys, [page(1000 * rnd + i) for i in range(60)]))
        gone = [key(i, "gone") for i in range(20)]
        assert all(old.publish_many(gone, [page(i) for i in range(20)]))
        port = int(old.address.rsplit(":", 1)[1])
        old.close(leave=False)  # as kill -9: nobody is told
        cfg = PeerConfig(**dict(cluster.config, rpc_port=port, discovery_addr=a.address))
        new = PeerNode(cfg, start=False, heartbeat_s=3600.0)
        cluster.nodes[1] = new
        assert new.node_id == old.node_id and new.incarnation > old.incarnation
        assert new.join()
        cluster.settle()
        assert all(new.publish_many(keys, [page(5000 + i) for i in range(60)]))  # generations 1..60
        for reader in (a, c):
            assert reader.membership.info(new.node_id) == new.membership.me
            bufs = [bytearray(PAGE) for _ in keys]
            assert all(reader.read_into(keys, [memoryview(b) for b in bufs]))
            assert [bytes(b) for b in bufs] == [page(5000 + i) for i in range(60)]
        # Nothing of the first run is left in any shard.
        for n in cluster.nodes:
            mine = [e for e in n.shard.snapshot().values() if e.node == new.node_id]
            assert all(e.incarnation == new.incarnation for e in mine)
        assert not any(a.read_into(gone, [memoryview(bytearray(PAGE)) for _ in gone]))


def _ready_endpoint(node: PeerNode) -> int:
    assert node.metrics_server is not None
    try:
        with urllib.request.urlopen(node.metrics_server.url + "/ready", timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_a_restarted_head_is_ready_only_with_the_cluster_back_in_its_view() -> None:
    """A head started alone waits out the members' probe period before it calls itself a
    new cluster. Restarted (with no seeds) after the others expired it, it is not ready
    (status, ``/ready``) until the members are back in its view and it holds its share:
    whenever it says ready, it lists every member and reads every page through its
    directory. (It used to be ready at once, alone, so reads through it missed.)"""
    clock = FakeClock()
    base = dict(metrics_enabled=False, cluster_token=secrets.token_hex(16), pool_size=64 * (PAGE + 64))

    def node(**cfg: Any) -> PeerNode:
        n = PeerNode(PeerConfig(**dict(base, **cfg)), start=False, heartbeat_s=1.0, clock=clock)
        n.join()
        return n

    def rounds(n: int = 1) -> None:
        for _ in range(n):
            clock.advance(1.0)
            for x in nodes:
                if not x._closed:
                    x.tick()
                    x.probe()

    head = node()
    nodes = [head]
    try:
        assert not head.is_ready()  # alone: maybe a restart the members have not found yet
        rounds(7)
        assert head.is_ready()  # nobody came within the probe period: a new cluster
        nodes += [node(discovery_addr=head.address) for _ in range(2)]
        rounds(2)
        assert all(n.is_ready() for n in nodes)
        producer = nodes[2]
        keys = [key(i, "head") for i in range(60)]
        assert all(producer.publish_many(keys, [page(i) for i in range(60)]))
        port = int(head.address.rsplit(":", 1)[1])
        head.close(leave=False)  # as kill -9
        rounds(5)
        assert all(head.node_id not in n.membership.members() for n in nodes[1:])
        new = node(rpc_port=port, metrics_enabled=True, metrics_port=0)  # the same command: no seeds
        nodes[0] = new
        assert new.node_id == head.node_id and list(new.membership.members()) == [new.node_id]
        assert not new.is_ready() and new.status()["ready"] is False and _ready_endpoint(new) == 503
        ids = {n.node_id for n in nodes}
        for _ in range(7):
            rounds()
            if new.is_ready():
                break
            assert new.status()["ready"] is False and _ready_endpoint(new) == 503
        assert new.is_ready() and new.status()["ready"] is True and _ready_endpoint(new) == 200
        assert set(new.membership.members()) == ids
        bufs = [bytearray(PAGE) for _ in keys]
        assert all(new.read_into(keys, [memoryview(b) for b in bufs]))
        assert [bytes(b) for b in bufs] == [page(i) for i in range(60)]
    finally:
        for n in nodes:
            n.close(leave=False)

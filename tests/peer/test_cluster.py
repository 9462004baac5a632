"""Multi-process peer cluster on 127.0.0.1: ``hiradix peer serve`` subprocesses with bounded
lifetimes, driven over authenticated RPC (``page_put``/``page_get``, ``node_status``) and
scraped over HTTP. Real time only here, always bounded by deadlines; waits poll a status.

One module-scoped scenario, in order (each step depends on the previous one):
set on one node and get on the others; ``kill -9`` of a producer; the head master dying;
a new node joining through another master; metrics scraped and parsed. Then clusters of
their own: nodes started with the README's commands, ``kill -9`` and restarted with the
same commands, rejoin; a node that cannot join exits and says why.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hiradix._ports import reusable_port
from hiradix.net.rpc import RpcClient

pytestmark = pytest.mark.slow  # in-process peer clusters over TCP

PAGE = 16 << 10
LIFETIME = 90  # seconds a node process may live at most, whatever happens to the test
HEARTBEAT = 0.2  # a silent member dies after 3 periods


def page(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def serve_cmd(*args: str) -> list[str]:
    cmd = [sys.executable, "-m", "hiradix.peer.cli", "serve", "--data-rpc", "--metrics-port", "0"]
    return cmd + ["--heartbeat", str(HEARTBEAT), "--lifetime", str(LIFETIME), "--pool-size", "16MiB", *args]


class Proc:
    """One ``hiradix peer serve`` process and the JSON line it printed."""

    def __init__(self, token: str, *args: str, log: Path | None = None) -> None:
        env = dict(os.environ, HIRADIX_CLUSTER_TOKEN=token)
        cmd = serve_cmd(*args)
        err = subprocess.DEVNULL if log is None else log.open("a")
        try:
            self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        finally:
            if log is not None:
                err.close()  # type: ignore[union-attr]
        assert self.p.stdout is not None
        line = self.p.stdout.readline()  # bounded: the node prints it once up, or exits
        if not line:
            self.p.kill()
            raise RuntimeError(f"node did not start: {cmd}")
        self.info: dict[str, Any] = json.loads(line)
        self.rpc: str = self.info["rpc"]

    def kill9(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)  # polling a remote status, not ordering events
    raise AssertionError(f"condition not met within {timeout}s")


class Cluster:
    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.procs: dict[str, Proc] = {}
        self.client = RpcClient(self.token, timeout=5.0)

    def start(self, name: str, *args: str, log: Path | None = None) -> Proc:
        old = self.procs.get(name)
        if old is not None:
            old.stop()
        self.procs[name] = p = Proc(self.token, *args, log=log)
        return p

    def call(self, name: str, method: str, *args: Any, timeout: float = 5.0) -> Any:
        return self.client.call(self.procs[name].rpc, method, *args, timeout=timeout)

    def members(self, name: str) -> set[str]:
        return set(self.call(name, "node_status")["members"])

    def status(self, name: str) -> dict[str, Any] | None:
        """The node's status, or ``None`` while it cannot answer (a restart: the pooled
        connection to the previous process breaks once)."""
        try:
            st: dict[str, Any] = self.call(name, "node_status")
        except Exception:
            return None
        return st

    def agree(self, names: str, ids: set[str]) -> bool:
        sts = [self.status(n) for n in names]
        return all(st is not None and set(st["members"]) == ids for st in sts)

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()
        self.client.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        head = c.start("a")
        c.start("b", "--discovery-addr", head.rpc)
        c.start("c", "--discovery-addr", head.rpc)
        ids = {p.info["node_id"] for p in c.procs.values()}
        for n in "abc":
            wait_for(lambda n=n: c.members(n) == ids)
        yield c
    finally:
        c.close()


def test_set_on_one_get_on_the_others(cluster: Cluster) -> None:
    keys = [f"a-{i:04d}" for i in range(64)]
    assert cluster.call("a", "page_put", keys, [page(i) for i in range(64)]) == [True] * 64
    for n in "bc":
        got = cluster.call(n, "page_get", keys, [PAGE] * 64)
        assert got == [page(i) for i in range(64)]
    ckeys = [f"c-{i:04d}" for i in range(32)]
    assert all(cluster.call("c", "page_put", ckeys, [page(1000 + i) for i in range(32)]))
    assert cluster.call("b", "page_get", ckeys, [PAGE] * 32) == [page(1000 + i) for i in range(32)]


def test_kill9_producer_reads_miss_quickly_others_unaffected(cluster: Cluster) -> None:
    c_id = cluster.procs["c"].info["node_id"]
    ckeys = [f"c-{i:04d}" for i in range(32)]
    akeys = [f"a-{i:04d}" for i in range(64)]
    cluster.procs["c"].kill9()
    t0 = time.monotonic()
    got = cluster.call("b", "page_get", ckeys, [PAGE] * 32, timeout=30.0)
    assert got == [None] * 32  # misses, not wrong bytes, not an exception
    assert time.monotonic() - t0 < 10.0  # read_timeout_s bounds it; connect refused is faster
    assert cluster.call("b", "page_get", akeys, [PAGE] * 64) == [page(i) for i in range(64)]
    # Replicas kept the directory entries of the pages whose primary owner was c.
    wait_for(lambda: c_id not in cluster.members("b") and c_id not in cluster.members("a"))
    assert cluster.call("b", "page_get", akeys, [PAGE] * 64) == [page(i) for i in range(64)]
    for n in "ab":
        assert cluster.call(n, "node_status")["directory_entries"] > 0


def test_head_dies_peers_keep_serving_and_new_node_joins(cluster: Cluster) -> None:
    a_id = cluster.procs["a"].info["node_id"]
    bkeys = [f"b-{i:04d}" for i in range(16)]
    assert all(cluster.call("b", "page_put", bkeys, [page(2000 + i) for i in range(16)]))
    cluster.procs["a"].kill9()
    wait_for(lambda: a_id not in cluster.members("b"))
    # A new node joins through b (the head is dead) and reads b's pages.
    b = cluster.procs["b"]
    cluster.start("d", "--discovery-addr", cluster.procs["a"].rpc, "--join", b.rpc)
    d_id = cluster.procs["d"].info["node_id"]
    wait_for(lambda: cluster.members("d") == {b.info["node_id"], d_id} == cluster.members("b"))
    assert cluster.call("d", "page_get", bkeys, [PAGE] * 16) == [page(2000 + i) for i in range(16)]
    dkeys = [f"d-{i:04d}" for i in range(8)]
    assert all(cluster.call("d", "page_put", dkeys, [page(3000 + i) for i in range(8)]))
    assert cluster.call("b", "page_get", dkeys, [PAGE] * 8) == [page(3000 + i) for i in range(8)]


def test_metrics_scraped_and_parsed(cluster: Cluster) -> None:
    url = cluster.procs["b"].info["metrics"]
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reads = fams["hiradix_peer_read_requests"].samples[0].value
    hits = fams["hiradix_peer_read_hits"].samples[0].value
    assert reads >= 64 + 32 + 32 and 0 < hits < reads
    assert fams["hiradix_peer_pool_keys"].samples[0].value == 16
    quantiles = {s.labels.get("quantile") for s in fams["hiradix_peer_op_latency_seconds"].samples}
    assert {"0.5", "0.9", "0.99"} <= quantiles
    with urllib.request.urlopen(url + "/", timeout=5) as r:
        assert b"hiradix peer cache" in r.read()


def test_status_cli(cluster: Cluster) -> None:
    env = dict(os.environ, HIRADIX_CLUSTER_TOKEN=cluster.token)
    out = subprocess.run(
        [sys.executable, "-m", "hiradix.peer.cli", "status", "--node", cluster.procs["b"].rpc],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "members     2" in out.stdout and "hit rate" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hiradix.peer.cli", "status", "--node", cluster.procs["b"].rpc],
        capture_output=True,
        text=True,
        env=dict(env, HIRADIX_CLUSTER_TOKEN="x" * 32),
        timeout=30,
    )
    assert bad.returncode == 1  # a wrong token is refused by the handshake


# ---------------------------------------------------------------------- restarts
def _get(c: Cluster, name: str, keys: list[str]) -> list[bytes | None]:
    try:
        got: list[bytes | None] = c.call(name, "page_get", keys, [PAGE] * len(keys))
    except Exception:  # the node is still coming up: not yet
        return [None] * len(keys)
    return got


def test_nodes_restarted_with_their_own_commands_rejoin(tmp_path: Path) -> None:
    """The README's commands: a head on a fixed port, others ``--join`` it. Each is killed
    with ``kill -9`` and restarted with the very command it was started with."""
    c = Cluster()
    try:
        head_cmd = ("--rpc-port", str(reusable_port()))
        head_addr = f"127.0.0.1:{head_cmd[1]}"
        b_cmd = ("--rpc-port", str(reusable_port()), "--join", head_addr)
        c.start("a", *head_cmd, log=tmp_path / "a.log")
        c.start("b", *b_cmd, log=tmp_path / "b.log")
        ids = {p.info["node_id"] for p in c.procs.values()}
        wait_for(lambda: c.agree("ab", ids))

        # The head dies and stays dead until the other has expired it.
        c.procs["a"].kill9()
        wait_for(lambda: head_addr not in (c.status("b") or {"members": [head_addr]})["members"])
        c.start("a", *head_cmd, log=tmp_path / "a.log")  # alone, with no seed to join
        wait_for(lambda: c.agree("ab", ids))
        wait_for(lambda: bool((c.status("a") or {}).get("ready")))
        akeys = [f"ra-{i:04d}" for i in range(32)]
        assert all(c.call("a", "page_put", akeys, [page(4000 + i) for i in range(32)]))
        wait_for(lambda: _get(c, "b", akeys) == [page(4000 + i) for i in range(32)])

        # A member restarted on its own ports: its new run replaces the old one everywhere,
        # even for keys the old run wrote with higher generations.
        bkeys = [f"rb-{i:04d}" for i in range(16)]
        for rnd in range(3):
            assert all(c.call("b", "page_put", bkeys, [page(5000 + 100 * rnd + i) for i in range(16)]))
        c.procs["b"].kill9()
        c.start("b", *b_cmd, log=tmp_path / "b.log")
        wait_for(lambda: c.agree("ab", ids))
        wait_for(lambda: bool((c.status("b") or {}).get("ready")))
        assert all(c.call("b", "page_put", bkeys, [page(6000 + i) for i in range(16)]))
        wait_for(lambda: _get(c, "a", bkeys) == [page(6000 + i) for i in range(16)])
    finally:
        c.close()
    b_log = (tmp_path / "b.log").read_text()
    assert f"member expired: {head_addr}" in b_log and f"member joined: {head_addr}" in b_log
    a_log = (tmp_path / "a.log").read_text()
    assert "INFO hiradix.peer.membership" in a_log and "member joined" in a_log


def _serve(token: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HIRADIX_CLUSTER_TOKEN=token)
    return subprocess.run(
        serve_cmd(*args), capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_a_node_that_cannot_join_fails_and_says_why(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{reusable_port()}"
    out = _serve("t" * 32, "--join", dead, "--join-timeout", "1")
    assert out.returncode == 1 and not out.stdout
    assert "cannot join the cluster" in out.stderr and dead in out.stderr and "Traceback" not in out.stderr
    # A wrong token is refused at once (no waiting out --join-timeout) and named as such.
    c = Cluster()
    try:
        head = c.start("a", log=tmp_path / "a.log")
        t0 = time.monotonic()
        out = _serve("w" * 32, "--join", head.rpc, "--join-timeout", "60")
        assert out.returncode == 1 and "cluster token was refused" in out.stderr
        assert time.monotonic() - t0 < 30.0
        assert c.members("a") == {head.info["node_id"]}
    finally:
        c.close()


def test_a_node_allowed_to_run_alone_says_so() -> None:
    dead = f"127.0.0.1:{reusable_port()}"
    out = _serve("t" * 32, "--join", dead, "--join-timeout", "0.5", "--allow-alone", "--lifetime", "0.5")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["ready"] is False
    assert "WARNING" in out.stderr and "running ALONE" in out.stderr

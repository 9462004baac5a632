"""Two hosts on one machine: ``hiradix peer serve --bind 0.0.0.0`` in two network namespaces
joined by a veth pair (10.213.0.1 and 10.213.0.2, a default route out of the veth). Each
node must advertise its namespace's address, never ``0.0.0.0``, and the two must form one
cluster that moves pages. The test creates and deletes the namespaces itself and skips
without root or ``ip``. Real time, bounded by deadlines."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.slow  # network namespaces and subprocess nodes

A_ADDR, B_ADDR = "10.213.0.1", "10.213.0.2"
LIFETIME = 60


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    if shutil.which("ip") is None:
        pytest.skip("needs the ip command (iproute2) to create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"hrx{tag}a", f"hrx{tag}b"
    made: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(ns)
        setup = [
            ("link", "add", f"hx{tag}a", "type", "veth", "peer", "name", f"hx{tag}b"),
            ("link", "set", f"hx{tag}a", "netns", ns_a),
            ("link", "set", f"hx{tag}b", "netns", ns_b),
        ]
        for ns, dev, addr in ((ns_a, f"hx{tag}a", A_ADDR), (ns_b, f"hx{tag}b", B_ADDR)):
            setup += [
                ("-n", ns, "link", "set", "lo", "up"),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "route", "add", "default", "dev", dev),
            ]
        for cmd in setup:
            r = _ip(*cmd)
            assert r.returncode == 0, f"ip {' '.join(cmd)}: {r.stderr}"
        yield ns_a, ns_b
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # takes the veth pair with it


def _serve(ns: str, token: str, *args: str) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "hiradix.peer.cli", "serve", "--bind", "0.0.0.0"]
    cmd += ["--data-rpc", "--metrics-port", "0", "--heartbeat", "0.2", "--lifetime", str(LIFETIME), *args]
    cmd += ["--pool-size", "16MiB"]
    env = dict(os.environ, HIRADIX_CLUSTER_TOKEN=token)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)


def _first_line(p: subprocess.Popen[str]) -> dict[str, object]:
    assert p.stdout is not None
    line = p.stdout.readline()  # bounded: printed once the node is up, or EOF when it exits
    assert line, f"node exited with {p.wait(timeout=10)}"
    info: dict[str, object] = json.loads(line)
    return info


# Runs inside namespace A: waits (bounded) for both nodes to list each other, writes pages on
# B and reads them through A (A's directory lookup and READ go to 10.213.0.2 over the veth).
_CHECK = textwrap.dedent(
    """
    import json, sys, time
    from hiradix.net.rpc import RpcClient
    a, b, ids = sys.argv[1], sys.argv[2], set(sys.argv[3:])
    c = RpcClient(timeout=5.0)
    deadline = time.monotonic() + 20
    while True:
        try:
            if all(set(c.call(n, "node_status")["members"]) == ids for n in (a, b)):
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the two namespaces never formed one cluster"
        time.sleep(0.05)  # polling remote processes
    keys = [f"ns-{i}" for i in range(16)]
    pages = [bytes([i]) * 4096 for i in range(16)]
    ok = c.call(b, "page_put", keys, pages)
    got = c.call(a, "page_get", keys, [4096] * 16)
    print(json.dumps({"put": ok, "same": got == pages, "ready": c.call(a, "node_status")["ready"]}))
    """
)


def test_wildcard_bind_advertises_the_interface_address(namespaces: tuple[str, str]) -> None:
    ns_a, ns_b = namespaces
    token = secrets.token_hex(16)
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(_serve(ns_a, token, "--rpc-port", "7000"))
        a = _first_line(procs[0])
        # A's address is derived from its default route; B names its own explicitly.
        assert a["node_id"] == a["rpc"] == f"{A_ADDR}:7000"
        assert str(a["data"]).startswith(f"{A_ADDR}:") and str(a["metrics"]).startswith(f"http://{A_ADDR}:")
        procs.append(_serve(ns_b, token, "--join", f"{A_ADDR}:7000", "--advertise-addr", B_ADDR))
        b = _first_line(procs[1])
        assert str(b["node_id"]).startswith(f"{B_ADDR}:") and "0.0.0.0" not in json.dumps(b)
        assert set(b["members"]) == {a["node_id"], b["node_id"]}  # type: ignore[call-overload]
        env = dict(os.environ, HIRADIX_CLUSTER_TOKEN=token)
        cmd = ["ip", "netns", "exec", ns_a, sys.executable, "-c", _CHECK, str(a["rpc"]), str(b["rpc"])]
        out = subprocess.run(
            [*cmd, str(a["node_id"]), str(b["node_id"])], capture_output=True, text=True, env=env, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"put": [True] * 16, "same": True, "ready": True}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

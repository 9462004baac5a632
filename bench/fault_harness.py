"""Fault harness for the peer cache: real ``hiradix peer serve`` processes on loopback,
a writer and readers that check every byte, and scripted faults.

It starts ``--nodes`` processes with the real CLI (``python -m hiradix.cli peer serve``:
own RPC and data ports, ``--metrics-port 0``, ``HIRADIX_CLUSTER_TOKEN`` set, ``--data-rpc``),
the first one the head and the others ``--join`` it. The writer puts pages on a producer
node (``page_put``); reader threads ask other nodes for them (``page_get``: directory
lookup, transport READ from the producer, slot verification). A page's bytes are derived
from its key (SHAKE-128 of the key), so every reader checks every page it gets.

Scenarios, in order (the fault ones repeated ``--rounds`` times, victims drawn from
``--seed``):

``baseline``       all nodes up: every page must hit.
``kill9``          ``kill -9`` of a producer while readers read: its pages must miss (never
                   wrong bytes), the others' must keep hitting; time until every other
                   node expired it.
``restart``        the killed node restarted with its very command: time from the restart
                   until its status says ready, until its ``/ready`` answers 200, until
                   every node lists it again, and until a page written to it is readable
                   through every other node. Its pages of the killed run must miss.
``sigstop``        ``SIGSTOP`` of another producer for longer than the membership TTL, then
                   ``SIGCONT``: time from ``SIGCONT`` until its earlier pages are readable
                   through every other node again, and until it is ready.
``pool_pressure``  writes of ``--pressure`` times each node's pool, so the pools evict
                   while readers read: misses allowed, wrong bytes never; the newest pages
                   must hit.

Per scenario and in total it prints reads (pages), hits, misses (``live``: of pages
whose producer was not under a fault), wrong bytes, failed calls and read latency (per
``page_get`` call of ``--batch`` pages: p50, p99, max), and the recovery times. It exits
with status 1 when any page had wrong bytes, a scenario did not run or a recovery missed
its deadline.

Every loop is bounded and every wait has a deadline; each node runs in its own process
group with ``--lifetime`` as a safety net, and all of them are killed at the end, also on
an error or a signal.

    python bench/fault_harness.py                       # 4 nodes, 2 rounds (~2 minutes)
    python bench/fault_harness.py --short --json out.json  # the ~30 s version (CI)
    python bench/fault_harness.py --nodes 5 --rounds 3 --seed 7 --duration 8
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import platform
import random
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiradix._ports import reusable_port
from hiradix.net.rpc import RpcClient

SCENARIOS = ("baseline", "kill9", "restart", "sigstop", "pool_pressure")
POLL_S = 0.05  # period of the recovery polls (remote status, not event ordering)
SLOT_OVERHEAD = 64  # a pool slot's header (hiradix.peer.pool.SLOT_HEADER_SIZE)


class HarnessError(RuntimeError):
    """The harness itself cannot go on (a node does not start, the time budget is spent)."""


def page_bytes(key: str, n: int) -> bytes:
    """The page of ``key``: ``n`` bytes any reader can recompute from the key alone."""
    return hashlib.shake_128(key.encode()).digest(n)


# ---------------------------------------------------------------------- node processes
class NodeProc:
    """One ``hiradix peer serve`` process, restartable with the very command it was
    started with; it runs in its own process group (``start_new_session``)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.env = env
        self.log = log
        self.p: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.run = -1  # how many times it was (re)started, minus one
        self.stopped = False  # SIGSTOPped
        # Readers go through it (a load balancer's view): up, and seen ready since its last
        # start or SIGCONT.
        self.serving = False

    @property
    def rpc(self) -> str:
        return str(self.info["rpc"])

    @property
    def node_id(self) -> str:
        return str(self.info["node_id"])

    @property
    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def start(self, timeout: float) -> None:
        """Start the process and read the JSON line it prints once up (``timeout`` s)."""
        self.spawn()
        self.wait_up(timeout)

    def spawn(self) -> None:
        """Start the process (:meth:`wait_up` waits until it is up)."""
        self.run += 1
        self.stopped = self.serving = False
        with self.log.open("ab") as err:
            self.p = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=self.env,
                start_new_session=True, bufsize=0,
            )  # fmt: skip
        _LIVE_GROUPS.add(self.p.pid)

    def wait_up(self, timeout: float) -> None:
        """Read the JSON line the process prints once up, ``timeout`` seconds at most."""
        assert self.p is not None and self.p.stdout is not None
        fd, buf, deadline = self.p.stdout.fileno(), b"", time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HarnessError(f"{self.name} printed no address line within {timeout:.0f}s ({self.log})")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise HarnessError(f"{self.name} exited with {self.p.wait(5)} before it was up ({self.log})")
                buf += chunk
        self.info = json.loads(buf.split(b"\n", 1)[0])

    def signal(self, sig: int) -> None:
        if self.p is not None and self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        if self.p is not None:
            self.p.wait(10)
            _LIVE_GROUPS.discard(self.p.pid)

    def terminate(self) -> None:
        """SIGTERM (after SIGCONT, were it stopped); :meth:`close` waits for it."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def close(self) -> None:
        """:meth:`terminate`, then SIGKILL after 5 s."""
        if self.p is None:
            return
        if self.p.poll() is None:
            self.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.p.wait(5)
        _LIVE_GROUPS.discard(self.p.pid)
        if self.p.stdout is not None:
            self.p.stdout.close()


_LIVE_GROUPS: set[int] = set()  # process groups still to kill at exit, whatever happens


@atexit.register
def _kill_leftovers() -> None:
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    _LIVE_GROUPS.clear()


# ---------------------------------------------------------------------- statistics
@dataclass
class Stats:
    """One scenario's reads, as the readers saw them."""

    name: str
    round: int
    reads: int = 0  # pages asked for
    hits: int = 0
    misses: int = 0
    misses_live: int = 0  # misses of pages whose producer was under no fault
    wrong: int = 0  # pages returned with other bytes than their key's
    calls: int = 0
    failed_calls: int = 0  # page_get calls that raised (a reader node stopped or killed)
    writes: int = 0
    failed_writes: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)
    recovery: dict[str, float | None] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_call(self, seconds: float, hits: int, misses: int, misses_live: int, wrong: int) -> None:
        with self.lock:
            self.calls += 1
            self.latencies.append(seconds)
            self.reads += hits + misses + wrong
            self.hits += hits
            self.misses += misses
            self.misses_live += misses_live
            self.wrong += wrong

    def add_failed_call(self, via: str, exc: BaseException) -> None:
        with self.lock:
            self.failed_calls += 1
            why = f"via {via}: {type(exc).__name__}" + (f" {exc}"[:80] if not isinstance(exc, OSError) else "")
            errors = self.notes.setdefault("failed_call_errors", {})
            errors[why] = errors.get(why, 0) + 1

    def add_wrong(self, n: int) -> None:
        with self.lock:
            self.reads += n
            self.wrong += n

    def summary(self) -> dict[str, Any]:
        with self.lock:
            lat = sorted(self.latencies)
            d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("latencies", "lock")}
            d["recovery"], d["notes"] = dict(self.recovery), dict(self.notes)
        d["latency_p50_s"] = _quantile(lat, 0.5)
        d["latency_p99_s"] = _quantile(lat, 0.99)
        d["latency_max_s"] = lat[-1] if lat else None
        return d


def _quantile(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


@dataclass(frozen=True)
class Written:
    """A page the writer put: its key, the producer node and which run of it."""

    key: str
    node: str
    run: int


# ---------------------------------------------------------------------- the harness
@dataclass(frozen=True)
class Plan:
    nodes: int
    rounds: int
    seed: int
    duration: float  # seconds of reading per phase
    heartbeat: float
    page: int
    pool: int  # bytes per node
    pages: int  # pages each producer writes per scenario
    batch: int  # pages per page_get call
    readers: int
    pressure: float  # pool_pressure writes this many times each pool
    timeout: float  # deadline of every wait (node start, recovery)
    call_timeout: float
    node_timeouts: float  # rpc/read/connect timeouts inside the nodes
    budget: float  # the whole run's deadline


class Harness:
    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir
        self.rng = random.Random(plan.seed)
        self.token = secrets.token_hex(16)
        self.client = RpcClient(self.token, timeout=plan.call_timeout)
        self.nodes: list[NodeProc] = []
        self.results: list[Stats] = []
        self.failures: list[str] = []
        self.deadline = time.monotonic() + plan.budget
        # What the readers read, and whose misses are expected: (node, run) under a fault.
        self._keys: list[Written] = []
        self._faulted: set[tuple[str, int]] = set()
        self._evicting = False
        self._key_lock = threading.Lock()
        self._stats = Stats("-", 0)
        self._stop_readers = threading.Event()
        self._readers: list[threading.Thread] = []
        self._uniq = 0

    # ------------------------------------------------------------------ set-up
    def start_cluster(self) -> None:
        p = self.plan
        cfg = self.workdir / "peer.json"
        t = p.node_timeouts
        cfg.write_text(json.dumps({
            "rpc_timeout_s": t, "read_timeout_s": t, "connect_timeout_s": t, "promote_timeout_s": t,
        }))  # fmt: skip
        env = dict(os.environ, HIRADIX_CLUSTER_TOKEN=self.token)
        lifetime = p.budget + 15  # a safety net: a node outlives a killed harness by no more
        for i in range(p.nodes):
            cmd = [
                sys.executable, "-m", "hiradix.cli", "peer", "serve", "--config", str(cfg), "--data-rpc",
                "--rpc-port", str(reusable_port()), "--data-port", str(reusable_port()), "--metrics-port", "0",
                "--pool-size", str(p.pool), "--page-size", str(p.page), "--heartbeat", str(p.heartbeat),
                "--lifetime", str(lifetime), "--log-level", "INFO",
            ]  # fmt: skip
            if self.nodes:
                cmd += ["--join", self.nodes[0].rpc]
            node = NodeProc(f"n{i}", cmd, env, self.workdir / f"n{i}.log")
            self.nodes.append(node)
            node.spawn()
            if i == 0:  # the head first: the others join it, side by side
                node.wait_up(p.timeout)
        for node in self.nodes[1:]:
            node.wait_up(p.timeout)
        ids = {n.node_id for n in self.nodes}
        agreed = lambda: all(self._members(n) == ids for n in self.nodes)  # noqa: E731
        if self._poll(lambda: agreed() and all(self._seen_ready(n) for n in self.nodes), p.timeout) is None:
            raise HarnessError(f"the {p.nodes} nodes did not agree and get ready within {p.timeout:.0f}s")

    def close(self) -> None:
        self._stop_readers.set()
        for t in self._readers:
            t.join(timeout=self.plan.call_timeout + 5)
        for n in self.nodes:
            n.terminate()  # all at once: each takes a while to leave
        for n in self.nodes:
            n.close()
        self.client.close()

    # ------------------------------------------------------------------ remote calls
    def _call(self, node: NodeProc, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self.client.call(node.rpc, method, *args, timeout=timeout or self.plan.call_timeout)

    def _status(self, node: NodeProc) -> dict[str, Any] | None:
        if not node.alive or node.stopped:
            return None
        try:
            st: dict[str, Any] = self._call(node, "node_status", timeout=2.0)
        except Exception:  # coming up, or gone: not yet
            return None
        return st

    def _members(self, node: NodeProc) -> set[str]:
        st = self._status(node)
        return set(st["members"]) if st else set()

    def _http_ready(self, node: NodeProc) -> bool:
        try:
            with urllib.request.urlopen(str(node.info["metrics"]) + "/ready", timeout=2.0) as r:
                return int(r.status) == 200
        except (OSError, urllib.error.HTTPError, ValueError):
            return False

    def _poll(self, cond: Callable[[], bool], timeout: float, t0: float | None = None) -> float | None:
        """Seconds from ``t0`` (now by default) until ``cond()``; ``None`` past ``timeout``."""
        t0 = time.monotonic() if t0 is None else t0
        end = min(t0 + timeout, self.deadline)
        while True:
            if cond():
                return time.monotonic() - t0
            if time.monotonic() >= end:
                return None
            time.sleep(POLL_S)

    def _live(self, exclude: NodeProc | None = None) -> list[NodeProc]:
        return [n for n in self.nodes if n.alive and not n.stopped and n is not exclude]

    def _serving(self) -> list[NodeProc]:
        return [n for n in self._live() if n.serving]

    def _seen_ready(self, node: NodeProc) -> bool:
        """Whether ``node``'s status says ready; from then on readers go through it."""
        node.serving = bool((self._status(node) or {}).get("ready"))
        return node.serving

    # ------------------------------------------------------------------ writer
    def _new_keys(self, scenario: str, node: NodeProc, n: int) -> list[str]:
        self._uniq += 1
        return [f"fh-{scenario}-{node.name}r{node.run}-{self._uniq}-{i:05d}" for i in range(n)]

    def write(self, node: NodeProc, keys: list[str], track: bool = True) -> list[str]:
        """Put ``keys`` on ``node`` in batches; the ones it stored (and, with ``track``,
        hands them to the readers)."""
        stored: list[str] = []
        for i in range(0, len(keys), 32):
            chunk = keys[i : i + 32]
            try:
                ok = self._call(node, "page_put", chunk, [page_bytes(k, self.plan.page) for k in chunk])
            except Exception:
                ok = [False] * len(chunk)
            good = [k for k, o in zip(chunk, ok, strict=True) if o]
            stored += good
            with self._stats.lock:
                self._stats.writes += len(chunk)
                self._stats.failed_writes += len(chunk) - len(good)
            if track:
                with self._key_lock:
                    self._keys += [Written(k, node.name, node.run) for k in good]
        return stored

    def read_ok(self, via: NodeProc, keys: list[str]) -> bool:
        """Whether every page of ``keys`` reads back right through ``via`` (a probe: not
        counted in the scenario's reads; wrong bytes are, and fail the run)."""
        try:
            got = self._call(via, "page_get", keys, [self.plan.page] * len(keys), timeout=5.0)
        except Exception:
            return False
        wrong = sum(g is not None and g != page_bytes(k, self.plan.page) for k, g in zip(keys, got, strict=True))
        if wrong:
            print(f"WRONG BYTES: {wrong} probe pages via {via.name}", file=sys.stderr)
            self._stats.add_wrong(wrong)
        return all(g is not None for g in got) and not wrong

    # ------------------------------------------------------------------ readers
    def _reader(self, idx: int) -> None:
        rng = random.Random(self.plan.seed * 7919 + idx)
        client = RpcClient(self.token, timeout=self.plan.call_timeout)
        try:
            while not self._stop_readers.is_set() and time.monotonic() < self.deadline:
                with self._key_lock:
                    pool = self._keys
                    picked = [pool[rng.randrange(len(pool))] for _ in range(self.plan.batch)] if pool else []
                    faulted = set(self._faulted)
                    evicting = self._evicting
                live = self._serving()
                if not picked or not live:
                    self._stop_readers.wait(POLL_S)
                    continue
                via = rng.choice(live)
                stats = self._stats
                t0 = time.perf_counter()
                try:
                    got = client.call(
                        via.rpc, "page_get", [w.key for w in picked], [self.plan.page] * len(picked),
                        timeout=self.plan.call_timeout,
                    )  # fmt: skip
                except Exception as exc:  # the reader node was stopped or killed under us
                    stats.add_failed_call(via.name, exc)
                    self._stop_readers.wait(POLL_S)
                    continue
                dt = time.perf_counter() - t0
                hits = misses = live_misses = wrong = 0
                for w, g in zip(picked, got, strict=True):
                    if g is None:
                        misses += 1
                        live_misses += not evicting and (w.node, w.run) not in faulted
                    elif g == page_bytes(w.key, self.plan.page):
                        hits += 1
                    else:
                        wrong += 1
                        print(f"WRONG BYTES: {w.key} via {via.name} (producer {w.node} run {w.run})", file=sys.stderr)
                stats.add_call(dt, hits, misses, live_misses, wrong)
        finally:
            client.close()

    def start_readers(self) -> None:
        for i in range(self.plan.readers):
            t = threading.Thread(target=self._reader, args=(i,), name=f"reader-{i}", daemon=True)
            t.start()
            self._readers.append(t)

    @contextlib.contextmanager
    def scenario(self, name: str, rnd: int) -> Iterator[Stats]:
        """A fresh key set and statistics for the readers; the scenario counts as run only
        if its body finishes."""
        stats = Stats(name, rnd)
        with self._key_lock:
            self._keys, self._faulted, self._evicting = [], set(), False
        self._stats = stats
        t0 = time.monotonic()
        yield stats
        stats.notes["seconds"] = round(time.monotonic() - t0, 2)
        self.results.append(stats)
        print(_row(stats.summary()), flush=True)

    def read_for(self, seconds: float) -> None:
        """Let the readers read (the harness thread just waits, bounded)."""
        self._stop_readers.wait(min(seconds, max(self.deadline - time.monotonic(), 0.0)))

    def _fault(self, node: NodeProc, on: bool) -> None:
        with self._key_lock:
            (self._faulted.add if on else self._faulted.discard)((node.name, node.run))

    # ------------------------------------------------------------------ scenarios
    def write_all(self, scenario: str) -> dict[str, list[str]]:
        return {n.name: self.write(n, self._new_keys(scenario, n, self.plan.pages)) for n in self._live()}

    def baseline(self) -> None:
        with self.scenario("baseline", 0):
            self.write_all("baseline")
            self.read_for(self.plan.duration)

    def kill_and_restart(self, rnd: int, victim: NodeProc) -> None:
        p = self.plan
        with self.scenario("kill9", rnd) as st:
            st.notes["victim"] = victim.name
            self.write_all("kill9")
            self.read_for(p.duration / 2)
            others = self._live(exclude=victim)
            self._fault(victim, True)
            t_kill = time.monotonic()
            victim.kill9()
            st.recovery["expired_s"] = self._poll(
                lambda: all(victim.node_id not in self._members(n) for n in others), p.timeout, t_kill
            )
            self.read_for(p.duration / 2)
            if st.recovery["expired_s"] is None:
                self.failures.append(f"kill9 round {rnd}: {victim.name} not expired within {p.timeout:.0f}s")
            with self._key_lock:
                old_run = [w for w in self._keys if w.node == victim.name]
        with self.scenario("restart", rnd) as st:
            st.notes["victim"] = victim.name
            with self._key_lock:  # its killed run's pages stay in the read set: they must miss
                self._keys += old_run
                self._faulted.add((victim.name, victim.run))
            for n in others:
                self.write(n, self._new_keys("restart", n, p.pages // 2))
            t0 = time.monotonic()
            victim.start(p.timeout)
            st.recovery["process_up_s"] = round(time.monotonic() - t0, 3)
            probe = self._new_keys("probe", victim, 8)
            written: list[str] = []
            ids = {n.node_id for n in self.nodes}

            def conditions() -> dict[str, Callable[[], bool]]:
                def readable() -> bool:
                    nonlocal written
                    if len(written) < len(probe):
                        written = self.write(victim, probe, track=False)
                        if len(written) < len(probe):
                            return False
                    return all(self.read_ok(n, probe) for n in others)

                return {
                    "status_ready_s": lambda: self._seen_ready(victim),
                    "http_ready_s": lambda: self._http_ready(victim),
                    "rejoined_s": lambda: all(self._members(n) == ids for n in self.nodes),
                    "readable_s": readable,
                }

            st.recovery.update(self._recover(conditions(), t0, f"restart round {rnd}"))
            self.write(victim, self._new_keys("restart", victim, p.pages // 2))  # its new run's pages must hit
            st.notes["old_run_pages"] = len(old_run)
            self.read_for(p.duration)

    def sigstop(self, rnd: int, victim: NodeProc) -> None:
        p = self.plan
        with self.scenario("sigstop", rnd) as st:
            st.notes["victim"] = victim.name
            keys = self.write_all("sigstop")
            others = self._live(exclude=victim)
            self.read_for(p.duration / 2)
            self._fault(victim, True)
            victim.signal(signal.SIGSTOP)
            victim.stopped, victim.serving = True, False
            t_stop = time.monotonic()
            # Stopped until every other node expired it, and two heartbeats more.
            st.recovery["expired_s"] = self._poll(
                lambda: all(victim.node_id not in self._members(n) for n in others), p.timeout, t_stop
            )
            if st.recovery["expired_s"] is None:
                self.failures.append(f"sigstop round {rnd}: {victim.name} not expired within {p.timeout:.0f}s")
            self.read_for(2 * p.heartbeat)
            st.notes["stopped_s"] = round(time.monotonic() - t_stop, 2)
            victim.signal(signal.SIGCONT)
            victim.stopped = False
            t0 = time.monotonic()
            sample = keys[victim.name][:16]
            ids = {n.node_id for n in self.nodes}
            st.recovery.update(
                self._recover(
                    {
                        "status_ready_s": lambda: self._seen_ready(victim),
                        "rejoined_s": lambda: all(self._members(n) == ids for n in self.nodes),
                        "readable_s": lambda: all(self.read_ok(n, sample) for n in others),
                    },
                    t0,
                    f"sigstop round {rnd}",
                )
            )
            self._fault(victim, False)  # from here on its pages must hit again
            self.read_for(p.duration / 2)

    def pool_pressure(self, rnd: int) -> None:
        p = self.plan
        with self.scenario("pool_pressure", rnd) as st:
            before = {n.name: (self._status(n) or {}).get("pool", {}).get("evictions", 0) for n in self._live()}
            with self._key_lock:
                self._evicting = True
            per_node = int(p.pressure * p.pool / (p.page + SLOT_OVERHEAD))
            slots = p.pool // (p.page + SLOT_OVERHEAD)
            last: dict[str, list[str]] = {}
            for n in self._live():
                keys = self._new_keys("pressure", n, per_node)
                self.write(n, keys)
                last[n.name] = keys[-max(slots // 4, 1) :]
            self.read_for(p.duration / 2)
            evictions = 0
            for n in self._live():
                evictions += (self._status(n) or {}).get("pool", {}).get("evictions", 0) - before.get(n.name, 0)
            st.notes["pages_written_per_node"] = per_node
            st.notes["pool_slots_per_node"] = slots
            st.notes["evictions"] = evictions
            # The newest quarter of each pool is never evicted by older writes: it must hit.
            via = {n.name: self._live(exclude=n)[0] for n in self._live()}
            recent = all(self.read_ok(via[name], keys) for name, keys in last.items())
            st.notes["newest_pages_hit"] = recent
            if not recent:
                self.failures.append(f"pool_pressure round {rnd}: the newest pages did not all read back")
            if evictions <= 0:
                self.failures.append(f"pool_pressure round {rnd}: no eviction happened")

    def _recover(self, conds: dict[str, Callable[[], bool]], t0: float, what: str) -> dict[str, float | None]:
        """Poll every condition (one pass each ``POLL_S``) until all hold or the deadline;
        the seconds from ``t0`` at which each first held (``None``: never)."""
        got: dict[str, float | None] = dict.fromkeys(conds)
        end = min(t0 + self.plan.timeout, self.deadline)
        while True:
            for name, cond in conds.items():
                if got[name] is None and cond():
                    got[name] = round(time.monotonic() - t0, 3)
            if all(v is not None for v in got.values()) or time.monotonic() >= end:
                break
            time.sleep(POLL_S)
        for name, v in got.items():
            if v is None:
                self.failures.append(f"{what}: {name[:-2]} not reached within {self.plan.timeout:.0f}s")
        return got

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        self.start_cluster()
        self.start_readers()
        self.baseline()
        for rnd in range(1, self.plan.rounds + 1):
            kill = self.rng.randrange(len(self.nodes))
            stop = self.rng.choice([i for i in range(len(self.nodes)) if i != kill])
            self.kill_and_restart(rnd, self.nodes[kill])
            self.sigstop(rnd, self.nodes[stop])
            self.pool_pressure(rnd)
        if time.monotonic() > self.deadline:
            self.failures.append(f"the run's budget of {self.plan.budget:.0f}s was spent: waits were cut short")


# ---------------------------------------------------------------------- report
_COLS = ("reads", "hits", "misses", "misses_live", "wrong", "failed_calls")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f}ms" if isinstance(v, float) else str(v)


def _row(s: dict[str, Any]) -> str:
    name = f"{s['name']}#{s['round']}" + (f" ({s['notes']['victim']})" if "victim" in s.get("notes", {}) else "")
    cells = " ".join(f"{_fmt(s.get(c)):>8}" for c in _COLS)
    lat = " ".join(f"{_fmt(s.get(c)):>7}" for c in ("latency_p50_s", "latency_p99_s", "latency_max_s"))
    rec = "  ".join(f"{k[:-2]} {v:.2f}s" if v is not None else f"{k[:-2]} NEVER" for k, v in s["recovery"].items())
    return f"{name:<22} {cells} {lat}  {rec}"


def _header() -> str:
    cols = " ".join(f"{c[:8]:>8}" for c in _COLS)
    since = "seconds: expired after the fault, the rest after the restart/SIGCONT"
    return f"{'scenario':<22} {cols} {'p50':>7} {'p99':>7} {'max':>7}  {since}"


def total(results: list[dict[str, Any]]) -> dict[str, Any]:
    t: dict[str, Any] = {c: sum(r[c] for r in results) for c in (*_COLS, "calls", "writes", "failed_writes")}
    lats = [r["latency_max_s"] for r in results if r["latency_max_s"] is not None]
    t["latency_max_s"] = max(lats) if lats else None
    return t


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in load],
    }


def build_plan(args: argparse.Namespace) -> Plan:
    short = args.short
    nodes = args.nodes or (3 if short else 4)
    rounds = args.rounds or (1 if short else 2)
    duration = args.duration or (1.2 if short else 6.0)
    heartbeat = args.heartbeat or (0.2 if short else 0.5)
    if nodes < 3:
        raise SystemExit("--nodes must be >= 3 (a victim, a second victim and a reader)")
    pool = (2 if short else 8) << 20
    budget = args.budget or (150.0 if short else 900.0)
    return Plan(
        nodes=nodes,
        rounds=rounds,
        seed=args.seed,
        duration=duration,
        heartbeat=heartbeat,
        page=16 << 10,
        pool=pool,
        pages=32 if short else 96,
        batch=16,
        readers=args.readers or (1 if short else 2),
        pressure=3.0,
        timeout=args.timeout,
        call_timeout=10.0,
        node_timeouts=2.0,
        budget=budget,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", type=int, help="node processes (default 4; --short 3)")
    ap.add_argument("--rounds", type=int, help="rounds of kill9/restart/sigstop/pool_pressure (default 2; --short 1)")
    ap.add_argument("--duration", type=float, help="seconds of reading per phase (default 6; --short 1.5)")
    ap.add_argument("--heartbeat", type=float, help="the nodes' heartbeat period (default 0.5; --short 0.2)")
    ap.add_argument("--readers", type=int, help="reader threads (default 2; --short 1)")
    ap.add_argument("--seed", type=int, default=0, help="picks the victims and the reads (default 0)")
    ap.add_argument("--timeout", type=float, default=30.0, help="deadline of every wait, seconds (default 30)")
    ap.add_argument("--budget", type=float, help="deadline of the whole run, seconds (default 900; --short 150)")
    ap.add_argument("--short", action="store_true", help="the ~30 s version (CI)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep-logs", type=Path, help="copy the nodes' logs into this directory")
    args = ap.parse_args(argv)
    plan = build_plan(args)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks below

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    start_machine = machine()
    print(f"fault harness: {plan.nodes} nodes, {plan.rounds} round(s), seed {plan.seed}; {start_machine}", flush=True)
    print(_header(), flush=True)
    error: str | None = None
    with tempfile.TemporaryDirectory(prefix="hiradix-faults-") as tmp:
        h = Harness(plan, Path(tmp))
        try:
            h.run()
        except HarnessError as exc:
            error = str(exc)
        finally:
            h.close()
            _kill_leftovers()
            if args.keep_logs is not None:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for f in Path(tmp).glob("*.log"):
                    (args.keep_logs / f.name).write_bytes(f.read_bytes())
    results = [s.summary() for s in h.results]
    ran = {(r["name"], r["round"]) for r in results}
    expected = {("baseline", 0)} | {(s, r) for r in range(1, plan.rounds + 1) for s in SCENARIOS[1:]}
    failures = list(h.failures)
    if error is not None:
        failures.append(f"harness: {error}")
    failures += [f"{name} round {rnd}: did not run" for name, rnd in sorted(expected - ran)]
    tot = total(results)
    if tot["wrong"]:
        failures.append(f"{tot['wrong']} pages read with wrong bytes")
    out = {
        "plan": asdict(plan),
        "machine": {"start": start_machine, "end": machine()},
        "seconds": round(time.monotonic() - t0, 1),
        "scenarios": results,
        "total": tot,
        "failures": failures,
        "ok": not failures,
    }
    tot_row = dict(tot, name="TOTAL", round=len(results), recovery={}, notes={})
    print(_row(tot_row), flush=True)
    print(f"{out['seconds']}s; load at the end {out['machine']['end']['loadavg_1_5_15']}", flush=True)
    for f in failures:
        print(f"FAILURE: {f}", flush=True)
    print("OK" if out["ok"] else "FAILED", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

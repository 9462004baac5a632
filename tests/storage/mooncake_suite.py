"""The storage contract and Mooncake-specific checks against a real ``mooncake_master``.

Not collected by itself (no ``test_`` prefix): ``test_storage_mooncake.py`` runs it with
pytest inside a network namespace of its own, because the Mooncake client's transfer
engine listens on ``0.0.0.0``. One master per module, on 127.0.0.1 with free ports; each
test gets a new client on an emptied store, as every backend gets a fresh store.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hiradix.storage import StorageConfig, StorageError, create_backend
from hiradix.storage.mooncake import MooncakeMaster, MooncakeStorage, mooncake_available
from tests.storage.test_contract import PAGE, StorageContract, key, make_pool, payload

if mooncake_available() is not None:  # the outer test skips before running this module
    pytest.skip(f"the Mooncake wheel does not import: {mooncake_available()}", allow_module_level=True)

SEGMENT = 64 << 20


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    m = MooncakeMaster(log_path=tmp_path_factory.mktemp("mooncake") / "master.log")
    yield m
    m.close()


def connect(master: MooncakeMaster, **extra: Any) -> MooncakeStorage:
    cfg = StorageConfig(extra_config={"master_server_addr": master.addr, "global_segment_size": SEGMENT, **extra})
    store = create_backend("mooncake", cfg)
    assert isinstance(store, MooncakeStorage)
    return store


class TestMooncakeContract(StorageContract):
    backend = "mooncake"

    @pytest.fixture(autouse=True)
    def _master(self, master: MooncakeMaster) -> None:
        self.master = master

    def make(self, tmp_path: Path, **extra: Any) -> MooncakeStorage:
        store = connect(self.master, **extra)
        store.clear()  # pages of the previous test's client may outlive it in the master
        return store


# ---------------------------------------------------------------------- Mooncake specific
@pytest.fixture
def store(master: MooncakeMaster) -> Iterator[MooncakeStorage]:
    s = connect(master)
    s.clear()
    yield s
    s.close()


def test_v1_is_zero_copy_from_and_into_the_registered_pool(store: MooncakeStorage, monkeypatch: Any) -> None:
    """Page-first v1 calls hand Mooncake addresses inside the registered host pool: no
    staging buffer is taken, and the pages read back are the pages written."""
    pool = make_pool("page_first", False, pages=16)
    store.register_mem_pool_host(pool)
    lo = pool.pages_array().ctypes.data
    hi = lo + pool.pages_array().nbytes
    seen: list[int] = []
    real = store.client

    class Spy:
        """Records the addresses handed to Mooncake (its pybind methods cannot be patched)."""

        def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int], cfg: Any) -> Any:
            seen.extend(ptrs)
            return real.batch_put_from(keys, ptrs, sizes, cfg)

        def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> Any:
            seen.extend(ptrs)
            return real.batch_get_into(keys, ptrs, sizes)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    def no_staging(n: int) -> Any:
        raise AssertionError("staging used on the zero-copy path")

    monkeypatch.setattr(store, "client", Spy())
    monkeypatch.setattr(store._staging, "acquire", no_staging)
    ps = pool.page_size
    keys = [key(i, "zc") for i in range(6)]
    expected = [pool.get_page_bytes(i * ps).clone() for i in range(6)]
    assert store.batch_set_v1(keys, np.arange(6) * ps) == [True] * 6
    assert store.batch_get_v1(keys, np.arange(6, 12) * ps) == [True] * 6
    for i, e in enumerate(expected):
        assert torch.equal(pool.get_page_bytes((6 + i) * ps), e)
    assert len(seen) == 12 and all(lo <= p < hi for p in seen)


def test_full_width_keys_and_other_clients_see_the_pages(master: MooncakeMaster, store: MooncakeStorage) -> None:
    """A 255-byte key is stored as given (not cut), and a second client reads it."""
    long_key = "k" * 255
    assert store.batch_set([long_key, key(1)], [payload(0), payload(1)])
    other = connect(master)
    try:
        assert other.batch_exists([long_key, key(1)]) == 2
        assert other.batch_exists(["k" * 254]) == 0
        got = other.batch_get([long_key, key(1)])
        assert [bytes(g.numpy()) for g in got] == [payload(0), payload(1)]
        assert other.get_stats().pages == 0  # usage counts this instance's own writes
    finally:
        other.close()


def test_large_batches_are_split(master: MooncakeMaster) -> None:
    s = connect(master, max_batch_keys=7)
    try:
        s.clear()
        keys = [key(i, "split") for i in range(40)]
        assert s.batch_set(keys, [payload(i, 256) for i in range(40)])
        assert s.batch_exists(keys) == 40
        assert [bytes(g.numpy()) for g in s.batch_get(keys)] == [payload(i, 256) for i in range(40)]
    finally:
        s.close()


def test_one_byte_pages_are_refused_and_empty_pages_kept(store: MooncakeStorage) -> None:
    assert store.batch_set_each([key(0), key(1)], [b"x", b""]) == [False, True]
    assert store.get(key(0)) is None
    got = store.get(key(1))
    assert got is not None and got.numel() == 0
    assert store.get(key(1), bytearray(1)) is None


def test_pages_mooncake_dropped_are_misses_and_leave_the_count(store: MooncakeStorage) -> None:
    """A page removed behind this instance's back (another client, Mooncake's eviction)
    reads as a miss, not an error, and leaves the usage count."""
    assert store.batch_set([key(0), key(1)], [payload(0), payload(1)])
    assert store.client.remove(key(0), True) == 0
    assert store.batch_get([key(0), key(1)], [bytearray(PAGE), bytearray(PAGE)])[0] is None
    st = store.get_stats()
    assert st.pages == 1 and st.errors == 0


def test_a_master_that_went_away_is_a_miss_not_an_exception(tmp_path: Path) -> None:
    m = MooncakeMaster(log_path=tmp_path / "m.log")
    s = connect(m)
    try:
        assert s.set(key(0), payload(0))
        m.close()
        done = threading.Event()
        out: dict[str, Any] = {}

        def calls() -> None:
            out["exists"] = s.batch_exists([key(0)])
            out["set"] = s.set(key(1), payload(1))
            done.set()

        t = threading.Thread(target=calls, daemon=True)
        t.start()
        assert done.wait(120), "Mooncake calls against a dead master did not return"
        assert out == {"exists": 0, "set": False}
        assert s.get_stats().errors >= 1
    finally:
        s.close()
        m.close()


def test_absent_master_fails_fast_with_a_clear_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: nothing answers there
        with pytest.raises(StorageError, match="does not answer"):
            create_backend("mooncake", StorageConfig(extra_config={"master_server_addr": f"127.0.0.1:{port}"}))


# ---------------------------------------------------------------------- the simulator
def _replay(**options: Any) -> Any:
    from hiradix.sim import Replayer
    from hiradix.sim.generators import ChatWorkload

    with Replayer(device_tokens=20_000, host_tokens=40_000, verify_bytes=True, **options) as r:
        return r.replay(ChatWorkload(requests=200, seed=4))


@pytest.mark.parametrize("l3_tokens", [None, 60_000], ids=["unbounded", "60k"])
def test_sim_through_mooncake_serves_the_memory_backends_hits(l3_tokens: int | None) -> None:
    """A private master per replay; the LRU bound of the memory backend, the same hits,
    and every reused KV byte checked through the L3."""
    memory = _replay(l3_backend="memory", l3_tokens=l3_tokens)
    mooncake = _replay(l3_backend="mooncake", l3_tokens=l3_tokens)
    assert memory.l3_hit_tokens > 0 and memory.verified_tokens > memory.l3_hit_tokens
    assert dataclasses.asdict(mooncake) == dataclasses.asdict(memory)
    assert mooncake.corrupt_tokens == 0


def test_sim_through_a_named_master(master: MooncakeMaster, capsys: pytest.CaptureFixture[str]) -> None:
    from hiradix.cli import main

    connect(master).clear()
    argv = ["sim", "--workload", "chat", "--requests", "120", "--device-tokens", "20k", "--host-tokens", "40k"]
    assert main([*argv, "--l3-backend", "mooncake", "--l3-master", master.addr, "--verify-bytes", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "L3 mooncake" in out and " reused tokens verified, 0 wrong" in out

"""``hiradix sim`` through the L3 a deployment runs: the peer cache (an in-process cluster
on loopback TCP) and Mooncake Store, against the memory backend, with every reused KV byte
checked (``verify_bytes``).

Mooncake's replays need a ``mooncake_master`` and a network namespace: they are in
``mooncake_suite.py`` (run by ``test_storage_mooncake.py``). Here: the peer cluster, the
byte check itself (it must catch a backend that returns wrong bytes), and the options'
errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hiradix.cli import main
from hiradix.sim import Replayer
from hiradix.sim.config import ConfigError, SimConfig
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.replay import kv_content
from hiradix.storage.memory import MemoryStorage

SMALL: dict[str, Any] = {"device_tokens": 20_000, "host_tokens": 40_000, "verify_bytes": True}


def replay(requests: int = 200, **options: Any) -> Any:
    with Replayer(**{**SMALL, **options}) as r:
        return r.replay(ChatWorkload(requests=requests, seed=4))


def test_peer_cluster_with_room_for_every_page_serves_the_memory_backends_hits() -> None:
    memory = replay(l3_backend="memory")
    peer = replay(l3_backend="peer")
    assert memory.l3_hit_tokens > 0 and memory.verified_tokens > memory.l3_hit_tokens
    assert dataclasses.asdict(peer) == dataclasses.asdict(memory)
    assert peer.corrupt_tokens == 0


def test_peer_cluster_sized_from_l3_tokens_holds_that_many_pages() -> None:
    cap = 60_000
    with Replayer(**SMALL, l3_backend="peer", l3_tokens=cap) as r:
        stats = r.replay(ChatWorkload(requests=200, seed=4))
        used = r.occupancy()["l3_used"]
        assert r.cache.storage.l3 is not None
        evictions = r.cache.storage.l3.backend.get_stats().evictions
    assert used == cap and evictions > 0
    assert 0 < stats.l3_hit_tokens < replay(l3_backend="memory").l3_hit_tokens
    assert stats.corrupt_tokens == 0


class _Flipping(MemoryStorage):
    """Returns every tenth page read with one byte changed."""

    reads = 0

    def _get_many_into(self, keys: list[str], outs: list[memoryview]) -> list[bool]:
        ok = super()._get_many_into(keys, outs)
        for i, out in enumerate(outs):
            _Flipping.reads += 1
            if ok[i] and _Flipping.reads % 10 == 0:
                out[0] ^= 0xFF
        return ok


def test_verify_bytes_catches_a_backend_that_returns_wrong_bytes() -> None:
    stats = replay(l3_backend=_Flipping())
    assert stats.l3_hit_tokens > 0 and 0 < stats.corrupt_tokens <= stats.l3_hit_tokens
    assert replay(l3_backend=MemoryStorage()).corrupt_tokens == 0


def test_kv_content_depends_on_token_position_and_predecessor() -> None:
    a = kv_content([1, 2, 3, 4])  # type: ignore[arg-type]
    assert a.shape == (4, 2) and a.dtype.name == "uint8"
    assert (kv_content([9, 2, 3, 4])[1] != a[1]).any()  # same token and position, other predecessor
    assert (kv_content([0, 1, 2, 3, 4])[2] != a[1]).any()  # same token and predecessor, other position
    assert (kv_content([1, 2, 3, 4]) == a).all()


def test_cli_replays_through_the_peer_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--workload", "chat", "--requests", "120", "--device-tokens", "20k", "--host-tokens", "40k"]
    assert main([*argv, "--l3-backend", "peer", "--verify-bytes", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "L3 peer" in out and " reused tokens verified, 0 wrong" in out


def test_l3_options_errors() -> None:
    with pytest.raises(ValueError, match="l3_master is for the mooncake backend"):
        Replayer(l3_backend="memory", l3_master="127.0.0.1:1")
    with pytest.raises(ConfigError, match="l3_master is for the mooncake backend"):
        SimConfig(l3_backend="peer", l3_master="127.0.0.1:1").resolve()
    with pytest.raises(ConfigError, match="l3_master"):
        SimConfig(l3_backend=None, l3_master="127.0.0.1:1").resolve()


def test_cli_mooncake_without_a_master_or_wheel_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hiradix.storage.mooncake as mc

    argv = ["sim", "--workload", "chat", "--requests", "20", "--device-tokens", "20k", "--host-tokens", "40k"]
    argv += ["--l3-backend", "mooncake", "--no-progress"]
    monkeypatch.setattr(mc, "mooncake_available", lambda: "ImportError: No module named 'mooncake'")
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "--l3-backend mooncake" in err and "requirements/mooncake.txt" in err
    monkeypatch.undo()
    if mc.mooncake_available() is None:  # with the wheel: a master that is not there
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            assert main([*argv, "--l3-master", f"127.0.0.1:{s.getsockname()[1]}"]) != 0
        assert "does not answer" in capsys.readouterr().err

"""The L3 controller's threads survive a backend (or an agreement) that raises: each
failure is a miss for that one operation, logged with the backend's name and counted,
every operation still reaches done, and later operations run normally. On the threads
and inline; and on two ranks, where a dead thread on one rank would leave the other
waiting in its MIN agreement (the hang the design warns about)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hiradix
from hiradix.cache.distributed import LocalAgreement
from hiradix.cache.l3 import L3Controller, PrefetchConfig
from hiradix.memory import HostKVPool, MHAShape
from hiradix.storage import Capabilities, MemoryStorage
from tests.cache import l3_fault_worker
from tests.support import run_ranks

pytestmark = pytest.mark.timeout(60)

PAGE = 16
WAIT = 10.0


class RaisingStorage(MemoryStorage):
    """A backend whose public batch calls raise while named in ``fail`` (``"exists"``,
    ``"get"``, ``"set"``): an override that bypasses the base class's error handling, as
    a third-party backend's may."""

    def __init__(self, v1: bool) -> None:
        super().__init__()
        self.fail: set[str] = set()
        if not v1:
            self.capabilities = Capabilities(supports_v1=False)

    def _check(self, call: str) -> None:
        if call in self.fail:
            raise RuntimeError(f"{call} exploded")

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        self._check("exists")
        return super().batch_exists(keys, extra_info)

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[Any] | None = None) -> list[Any]:
        self._check("get")
        return super().batch_get(keys, target_locations)

    def batch_get_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        self._check("get")
        return super().batch_get_v1(keys, host_indices, extra_info)

    def batch_set(self, keys: Sequence[str], values: Sequence[Any]) -> bool:
        self._check("set")
        return super().batch_set(keys, values)

    def batch_set_v1(self, keys: Sequence[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        self._check("set")
        return super().batch_set_v1(keys, host_indices, extra_info)


class FlakyAgreement(LocalAgreement):
    """The single-rank agreement, whose next ``min_int`` raises while ``broken``."""

    broken = False

    def min_int(self, value: int) -> int:
        if self.broken:
            self.broken = False
            raise RuntimeError("collective timed out")
        return super().min_int(value)


def _setup(v1: bool, inline: bool) -> tuple[L3Controller, RaisingStorage, FlakyAgreement, HostKVPool]:
    pool = HostKVPool(MHAShape(2, 2, 4), 512, PAGE, torch.float32, "page_first", reserve_bytes=0)
    backend = RaisingStorage(v1)
    agreement = FlakyAgreement()
    config = PrefetchConfig(policy="wait_complete", threshold_tokens=PAGE, batch_pages=2)
    l3 = L3Controller(backend, pool, config=config, agreement=agreement, inline=inline)
    assert l3.use_v1 == v1
    return l3, backend, agreement, pool


@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_backend_exceptions_are_misses_and_every_op_reaches_done(
    v1: bool, inline: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hiradix.cache.l3")
    l3, backend, agreement, pool = _setup(v1, inline)
    tokens = np.arange(4 * PAGE)
    hashes = [str(h) for h in hiradix.page_hashes(tokens, PAGE)]
    src = pool.alloc(len(tokens))
    assert src is not None
    starts = src[::PAGE]
    pages = torch.arange(4 * pool.page_bytes, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, -1)
    pool.write_pages(starts, pages)

    def prefetch(req: int) -> Any:
        dst = pool.alloc(len(tokens))
        assert dst is not None
        op = l3.prefetch(req, dst, tokens, None)
        assert op.io_done.wait(WAIT), f"prefetch {req} never reached done"
        return op, dst

    try:
        backend.fail = {"set"}
        b = l3.backup(1, hashes, src)
        assert b.done.wait(WAIT) and b.stored_pages == 0  # nothing stored
        backend.fail = set()
        b = l3.backup(2, hashes, src)
        assert b.done.wait(WAIT) and b.stored_pages == 4  # the backup thread lives on

        backend.fail = {"exists"}
        op, _ = prefetch(10)
        assert op.hit_pages == 0 and op.revoked and op.completed_pages == 0

        backend.fail = {"get"}
        op, _ = prefetch(11)
        assert op.hit_pages == 4 and op.completed_pages == 0  # agreed hits, none landed

        backend.fail = set()
        agreement.broken = True
        op, _ = prefetch(12)
        assert op.hit_pages == 0 and op.completed_pages == 0

        op, dst = prefetch(13)  # and later operations still complete, with the right bytes
        assert op.completed_pages == 4
        out = torch.empty_like(pages)
        pool.read_pages(dst[::PAGE], out)
        assert torch.equal(out, pages)
        if not inline:
            assert all(t.is_alive() for t in l3._threads)
    finally:
        l3.stop()
    s = l3.stats
    assert (s["backup_errors"], s["prefetch_query_errors"], s["prefetch_read_errors"], s["agreement_errors"]) == (
        1,
        1,
        1,
        1,
    )
    assert s["backup_failed_pages"] == 4 and s["backup_pages"] == 4
    assert s["prefetch_failed_pages"] == 4 and s["prefetch_loaded_pages"] == 4
    warned = [r for r in caplog.records if r.name == "hiradix.cache.l3"]
    assert len(warned) == 4 and all("RaisingStorage" in r.getMessage() for r in warned)
    assert all(r.exc_info for r in warned)  # the first of each kind comes with its traceback


def test_only_the_first_failure_of_a_kind_logs_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hiradix.cache.l3")
    l3, backend, _, pool = _setup(True, False)
    tokens = np.arange(2 * PAGE)
    backend.fail = {"exists"}
    try:
        for req in range(3):
            dst = pool.alloc(len(tokens))
            assert dst is not None
            assert l3.prefetch(req, dst, tokens, None).io_done.wait(WAIT)
    finally:
        l3.stop()
    assert l3.stats["prefetch_query_errors"] == 3
    assert [bool(r.exc_info) for r in caplog.records if r.name == "hiradix.cache.l3"] == [True, False, False]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.timeout(150)
def test_two_ranks_complete_when_one_ranks_backend_raises(tmp_path: Path) -> None:
    """Rank 1's backend raises in batch_set (sequence 0), batch_exists (1) and batch_get
    (2). Its L3 threads live on and make every agreement, so neither rank hangs, both
    agree on what loaded and the trees stay identical; sequence 3 loads everywhere."""
    # 90 s: it takes seconds; a rank that skipped an agreement hangs
    r0, r1 = run_ranks(l3_fault_worker.rank_main, 2, tmp_path, {"collective_timeout_s": 30}, 90)
    assert r0["loaded"] == r1["loaded"] == [0, 0, 0, 160]
    assert r0["fingerprint"] == r1["fingerprint"] and r0["pending"] == r1["pending"] == 0
    errors = ("backup_errors", "prefetch_query_errors", "prefetch_read_errors", "agreement_errors")
    assert [r1["l3"][k] for k in errors] == [1, 1, 1, 0]
    assert [r0["l3"][k] for k in errors] == [0, 0, 0, 0]

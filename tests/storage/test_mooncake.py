"""The Mooncake Store backend (``hiradix.storage.mooncake``).

The storage contract and the Mooncake-specific tests live in ``mooncake_suite.py`` and run
against a real ``mooncake_master`` that the suite starts on 127.0.0.1. The Mooncake
client's transfer engine listens on ``0.0.0.0`` (it has no option to bind elsewhere), so
the suite runs with pytest in a network namespace of its own (``hiradix._netns``), where
``0.0.0.0`` means that namespace's loopback only. Skipped, saying why, when the Mooncake
wheel does not import or the namespace cannot be made. What needs no master runs here.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from hiradix._netns import NO_NETNS, run_in_private_netns
from hiradix.storage import StorageConfig, StorageError, backend_names, create_backend
from hiradix.storage.mooncake import MOONCAKE_INSTALL_HINT, mooncake_available
from tests.support import REPO

pytestmark = pytest.mark.slow  # a real mooncake_master, also in a private network namespace

HERE = Path(__file__).resolve().parent
WHY_NOT = mooncake_available()
needs_wheel = pytest.mark.skipif(
    WHY_NOT is not None, reason=f"the Mooncake wheel does not import ({WHY_NOT}); {MOONCAKE_INSTALL_HINT}"
)


@needs_wheel
def test_contract_against_a_real_master_in_a_private_network_namespace() -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "mooncake_suite.py")]
    res = run_in_private_netns(cmd, timeout=900, cwd=str(REPO))
    if res.returncode == NO_NETNS:
        pytest.skip(f"no network namespace for the Mooncake client here: {res.stderr.strip()}")
    summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    assert res.returncode == 0, f"mooncake suite failed ({summary}):\n{res.stdout[-6000:]}\n{res.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30, summary
    assert not re.search(r"failed|error|skipped", summary), summary


def test_registered_by_name() -> None:
    assert "mooncake" in backend_names()


def test_a_master_address_is_required() -> None:
    with pytest.raises(StorageError, match="master_server_addr"):
        create_backend("mooncake", StorageConfig())
    with pytest.raises(StorageError, match="host:port"):
        create_backend("mooncake", StorageConfig(extra_config={"master_server_addr": "nohostport"}))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"protocol": "udp"}, "protocol"),
        ({"max_batch_keys": 0}, "max_batch_keys"),
        ({"global_segment_size": "lots"}, "global_segment_size"),
        ({"capacity_bytes": 0}, "capacity_bytes"),
    ],
)
def test_bad_options_are_refused_before_connecting(extra: dict[str, object], match: str) -> None:
    cfg = StorageConfig(extra_config={"master_server_addr": "127.0.0.1:1", **extra})
    with pytest.raises(StorageError, match=match):
        create_backend("mooncake", cfg)


def test_without_the_wheel_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import hiradix.storage.mooncake as mc

    monkeypatch.setattr(mc, "mooncake_available", lambda: "ImportError: No module named 'mooncake'")
    cfg = StorageConfig(extra_config={"master_server_addr": "127.0.0.1:1"})
    with pytest.raises(StorageError, match=re.escape("requirements/mooncake.txt")):
        create_backend("mooncake", cfg)
    with pytest.raises(StorageError, match="libibverbs1"):
        mc.MooncakeMaster()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a network namespace needs root")
def test_private_namespace_has_only_its_own_loopback() -> None:
    code = (
        "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
        "socket.create_connection(('127.0.0.1', s.getsockname()[1])).close(); "
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))"
    )
    res = run_in_private_netns([sys.executable, "-c", code], timeout=60)
    if res.returncode == NO_NETNS:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['lo']"

"""The top-level ``hiradix`` command carries the peer-cache subcommands."""

from __future__ import annotations

import pytest

from hiradix.cli import main

pytestmark = pytest.mark.slow  # peer nodes as subprocesses of the command line


def test_peer_help_is_reachable_from_hiradix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["peer", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "status" in out and "127.0.0.1" in out


def test_peer_status_of_nothing_fails_cleanly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIRADIX_CLUSTER_TOKEN", "a-test-token-of-enough-length")
    status = main(["peer", "status", "--node", "127.0.0.1:9", "--timeout", "2"])
    assert status != 0
    assert "Traceback" not in capsys.readouterr().err

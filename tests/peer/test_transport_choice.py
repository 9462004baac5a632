"""Which transport a peer node runs: ``PeerConfig.transport``, the one factory
(:func:`hiradix.peer.transports.make_transport`), injection into ``PeerNode`` and the
``--transport`` flag of ``hiradix peer serve``."""

from __future__ import annotations

import logging
import re
import secrets
import signal
import socket
import sys
import types
from typing import Any

import pytest

import hiradix.peer.transports as factory
from hiradix.peer.cli import _config, build_parser, main
from hiradix.peer.config import ConfigError, PeerConfig
from hiradix.peer.node import PeerNode
from hiradix.peer.transports import make_transport, rdma_unavailable
from hiradix.transport import FakeFabric, FakeTransport, TcpTransport, Transport, TransportError, TransportUnavailable

TOKEN = secrets.token_hex(16)
NO_RDMA = rdma_unavailable()


def cfg(**kw: Any) -> PeerConfig:
    return PeerConfig(cluster_token=TOKEN, metrics_enabled=False, pool_size=1 << 20, **kw)


@pytest.fixture
def no_rdma(monkeypatch: pytest.MonkeyPatch) -> str:
    why = "no RDMA device with an ACTIVE port (test)"
    monkeypatch.setattr(factory, "rdma_unavailable", lambda: why)
    return why


# ---------------------------------------------------------------------- config
def test_transport_defaults_to_auto_and_takes_each_value() -> None:
    assert cfg().transport == "auto"
    for t in ("auto", "tcp", "rdma", "fake"):
        assert cfg(transport=t).transport == t
    assert PeerConfig.from_dict({"transport": "tcp"}).transport == "tcp"


@pytest.mark.parametrize("bad", ["TCP", "ib", "", None, 1])
def test_a_bad_transport_is_refused_naming_the_field_and_the_choices(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"transport: expected one of 'auto', 'tcp', 'rdma', 'fake', got"):
        cfg(transport=bad)


# ---------------------------------------------------------------------- factory
def test_tcp_is_the_tcp_transport_with_the_node_settings() -> None:
    c = cfg(transport="tcp", max_channels_per_peer=3, max_connections=7, idle_timeout_s=9.0)
    t = make_transport(c.transport_choice(), "n")
    try:
        assert isinstance(t, TcpTransport) and t.capabilities.kind == "tcp"
        assert t.max_connections == 7 and t.idle_timeout == 9.0
        host, _, port = t.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert t.advertised_address("10.0.0.5") == f"10.0.0.5:{port}"
    finally:
        t.close()


@pytest.mark.parametrize("kind", ["fake", "auto"])
def test_a_fabric_gives_the_fake_nic_named_after_the_node(kind: str) -> None:
    t = make_transport(cfg(transport=kind).transport_choice(), "node-a", FakeFabric())
    try:
        assert isinstance(t, FakeTransport) and t.address == "node-a"
        assert t.advertised_address("10.0.0.5") == "node-a"  # no socket: its name everywhere
    finally:
        t.close()


def test_fake_needs_a_fabric_and_a_fabric_needs_fake_or_auto() -> None:
    with pytest.raises(TransportUnavailable, match="needs a FakeFabric"):
        make_transport(cfg(transport="fake").transport_choice(), "n")
    with pytest.raises(TransportUnavailable, match="a fake fabric was given but transport is 'tcp'"):
        make_transport(cfg(transport="tcp").transport_choice(), "n", FakeFabric())


def test_rdma_without_a_port_fails_naming_the_reason(no_rdma: str) -> None:
    with pytest.raises(TransportUnavailable, match="transport 'rdma' cannot run here") as exc:
        make_transport(cfg(transport="rdma").transport_choice(), "n")
    assert no_rdma in str(exc.value)
    assert isinstance(exc.value, TransportError) and isinstance(exc.value, ValueError)


@pytest.mark.skipif(NO_RDMA is None, reason="this machine has an ACTIVE RDMA port")
def test_rdma_here_fails_with_the_real_reason() -> None:
    assert NO_RDMA
    with pytest.raises(TransportUnavailable) as exc:
        make_transport(cfg(transport="rdma").transport_choice(), "n")
    assert NO_RDMA in str(exc.value)


def test_auto_without_rdma_is_tcp_with_one_info_line(no_rdma: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="hiradix"):
        t = make_transport(cfg().transport_choice(), "node-x")
    try:
        assert isinstance(t, TcpTransport)
    finally:
        t.close()
    lines = [r for r in caplog.records if r.name.startswith("hiradix")]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO and lines[0].name == "hiradix.peer"
    assert "node-x" in lines[0].getMessage() and "TCP" in lines[0].getMessage()
    assert no_rdma in lines[0].getMessage()


def test_auto_takes_rdma_where_it_can_run(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With an ACTIVE port, ``auto`` builds ``RdmaTransport`` with the TCP transport's
    settings (the signature the RDMA module implements), and says nothing."""
    built: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Rdma(FakeTransport):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append((args, kwargs))
            super().__init__(FakeFabric(), "node-r")

    module = types.ModuleType("hiradix.transport.rdma")
    module.RdmaTransport = Rdma  # type: ignore[attr-defined]
    module.rdma_unavailable_reason = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hiradix.transport.rdma", module)
    assert rdma_unavailable() is None
    c = cfg(data_port=0, max_channels_per_peer=5, read_timeout_s=3.0, connect_timeout_s=2.0, max_connections=9)
    with caplog.at_level(logging.DEBUG, logger="hiradix"):
        t = make_transport(c.transport_choice(), "node-r", token=b"t" * 16)
    t.close()
    assert isinstance(t, Rdma) and not caplog.records
    assert built == [
        (
            (b"t" * 16,),
            {
                "host": "127.0.0.1",
                "port": 0,
                "max_channels_per_peer": 5,
                "timeout": 3.0,
                "handshake_timeout": 2.0,
                "max_connections": 9,
                "idle_timeout": 300.0,
            },
        )
    ]


def test_a_module_that_does_not_import_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hiradix.transport.rdma", None)  # import raises ImportError
    why = rdma_unavailable()
    assert why is not None and "does not import" in why


# ---------------------------------------------------------------------- injection
def test_the_node_takes_a_transport_instance_or_a_factory() -> None:
    fabric = FakeFabric()
    made: list[str] = []

    def build(node_id: str) -> Transport:
        made.append(node_id)
        return FakeTransport(fabric, node_id)

    given = FakeTransport(fabric, "given")
    with (
        PeerNode(cfg(), transport=given, start=False) as a,
        PeerNode(cfg(discovery_addr=a.address), transport=build, start=False) as b,
    ):
        assert a.transport is given and a.data_address == "given"
        assert made == [b.node_id] and b.data_address == b.node_id
        a.join()
        b.join()
        for node in (a, b, a, b):  # heartbeat rounds until both views agree
            node.tick()
        assert a.publish_many(["k"], [b"page"]) == [True]
        out = bytearray(4)
        assert b.read_into(["k"], [memoryview(out)]) == [True] and bytes(out) == b"page"
    assert given._closed  # the node owns what it was given


def test_fabric_and_transport_together_or_a_bad_transport_are_refused() -> None:
    fabric = FakeFabric()
    given = FakeTransport(fabric, "x")
    with pytest.raises(ValueError, match=r"fabric= .* or transport=, not both"):
        PeerNode(cfg(), fabric=fabric, transport=given, start=False)
    given.close()
    with pytest.raises(TypeError, match="transport must be a Transport or a factory of one, got str"):
        PeerNode(cfg(), transport="tcp", start=False)  # type: ignore[arg-type]


def test_a_node_whose_transport_cannot_run_fails_to_start_cleanly(no_rdma: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportUnavailable, match=re.escape(no_rdma)):
        PeerNode(cfg(transport="rdma", rpc_port=port), start=False)
    # what it opened before the transport (the RPC listener) was closed again
    PeerNode(cfg(transport="tcp", rpc_port=port), start=False).close()


# ---------------------------------------------------------------------- CLI
def test_serve_takes_transport() -> None:
    parser = build_parser()
    assert _config(parser.parse_args(["serve", "--transport", "tcp"])).transport == "tcp"
    assert _config(parser.parse_args(["serve", "--transport", "rdma"])).transport == "rdma"
    args = parser.parse_args(["serve"])
    assert _config(args).transport == "auto"


def test_serve_refuses_an_unknown_transport(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--transport", "infiniband"])
    assert exc.value.code == 2
    assert "invalid choice: 'infiniband'" in capsys.readouterr().err


def test_serve_rdma_without_a_port_exits_1_saying_why(
    no_rdma: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIRADIX_CLUSTER_TOKEN", TOKEN)
    # serve configures the root logger and the process's signals: not in the test process
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    status = main(["serve", "--transport", "rdma", "--no-metrics", "--lifetime", "0"])
    err = capsys.readouterr().err
    assert status == 1
    assert "cannot start: transport 'rdma' cannot run here" in err and no_rdma in err
    assert "Traceback" not in err


def test_the_real_rdma_transport_takes_the_settings_the_factory_passes() -> None:
    """The mocked module above pins the call; this pins that the real class accepts it
    (binding only: no RDMA device here to build one)."""
    import inspect

    from hiradix.transport.rdma import RdmaTransport

    inspect.signature(RdmaTransport).bind(b"t" * 16, **cfg().transport_settings().socket_kwargs())

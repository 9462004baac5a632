"""PeerConfig: defaults, validation with clear errors, JSON/TOML loading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hiradix.peer.config import ConfigError, PeerConfig
from hiradix.settings import parse_size


def test_defaults_match_the_seed() -> None:
    c = PeerConfig()
    assert (c.max_masters, c.virtual_nodes, c.directory_replicas, c.max_channels_per_peer) == (3, 160, 2, 16)
    assert c.bind_host == "127.0.0.1" and c.metrics_port == 31997 and c.metrics_enabled
    assert c.disk_size == 100 * 2**30 and not c.disk_enabled
    assert c.effective_metrics_host == "127.0.0.1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.virtual_nodes = 1  # type: ignore[misc]


def test_token_never_in_repr() -> None:
    c = PeerConfig(cluster_token="s3cret")
    assert "s3cret" not in repr(c) and c.to_dict()["cluster_token"] == "s3cret"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rpc_port": 70000}, r"rpc_port: must be 0\.\.65535"),
        ({"virtual_nodes": 0}, "virtual_nodes"),
        ({"directory_replicas": True}, "directory_replicas: expected an integer"),
        ({"max_masters": "3"}, "max_masters: expected an integer"),
        ({"pool_size": 0}, "pool_size"),
        ({"page_size": 4096, "pool_size": 4000}, "cannot hold one page"),
        ({"disk_enabled": "yes"}, "disk_enabled: expected true/false"),
        ({"rpc_timeout_s": 0}, "rpc_timeout_s"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s"),
        ({"discovery_addr": "nohost"}, "discovery_addr"),
        ({"bind_host": ""}, "bind_host"),
        ({"pool_policy": "mru"}, "pool_policy"),
        ({"cluster_token": ""}, "cluster_token"),
        ({"pool_size": "12 parsecs"}, "cannot parse size"),
    ],
)
def test_validation_errors_name_the_field(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=match):
        PeerConfig(**kwargs)


def test_non_loopback_bind_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIRADIX_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="not loopback"):
        PeerConfig(bind_host="0.0.0.0")
    with pytest.raises(ConfigError, match="not loopback"):
        PeerConfig(metrics_host="10.0.0.1")
    assert PeerConfig(bind_host="0.0.0.0", cluster_token="t").bind_host == "0.0.0.0"
    assert PeerConfig(bind_host="::1").bind_host == "::1"
    monkeypatch.setenv("HIRADIX_CLUSTER_TOKEN", "from-env")
    assert PeerConfig(bind_host="0.0.0.0").cluster_token is None


def test_sizes() -> None:
    assert parse_size("64KiB") == 65536 and parse_size("100GB") == 100 * 10**9 and parse_size("7") == 7
    assert PeerConfig(pool_size="2GiB", page_size="1MiB").page_size == 1 << 20  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="whole number"):
        parse_size("1.5B")
    with pytest.raises(ConfigError):
        parse_size(True)  # type: ignore[arg-type]


def test_from_json_and_toml(tmp_path: Path) -> None:
    j = tmp_path / "peer.json"
    j.write_text(json.dumps({"peer": {"pool_size": "64MiB", "page_size": 65536, "disk_enabled": True}}))
    c = PeerConfig.from_file(j)
    assert c.pool_size == 64 << 20 and c.page_size == 65536 and c.disk_enabled
    t = tmp_path / "peer.toml"
    t.write_text('directory_replicas = 3\ndisk_path = "/tmp/x"\nrpc_timeout_s = 2.5\ndiscovery_addr = "head:9000"\n')
    c = PeerConfig.from_file(t)
    assert (c.directory_replicas, c.disk_path, c.rpc_timeout_s, c.discovery_addr) == (3, "/tmp/x", 2.5, "head:9000")
    assert c.replace(directory_replicas=1).directory_replicas == 1
    with pytest.raises(ConfigError, match="virtual_nodes"):
        c.replace(virtual_nodes=-1)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        PeerConfig.from_file(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("directory_replica = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'directory_replicas'"):
        PeerConfig.from_file(typo)
    with pytest.raises(ConfigError, match=r"typo\.toml"):
        PeerConfig.from_file(typo)
    badtoml = tmp_path / "bad.toml"
    badtoml.write_text("x = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        PeerConfig.from_file(badtoml)
    with pytest.raises(ConfigError, match="cannot read"):
        PeerConfig.from_file(tmp_path / "missing.json")
    yml = tmp_path / "c.yaml"
    yml.write_text("a: 1")
    with pytest.raises(ConfigError, match=r"\.json or \.toml"):
        PeerConfig.from_file(yml)
    with pytest.raises(ConfigError, match="expected a table"):
        PeerConfig.from_dict([1, 2])  # type: ignore[arg-type]


def test_advertised_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from hiradix.net import address as config_mod

    assert PeerConfig().advertised_host() == "127.0.0.1"
    assert PeerConfig(bind_host="10.1.2.3", cluster_token="t" * 32).advertised_host() == "10.1.2.3"
    assert PeerConfig(advertise_addr="node-7.example").advertised_host() == "node-7.example"
    for bad in ("0.0.0.0", "::", "host:7000", "a b"):
        with pytest.raises(ConfigError, match="advertise_addr"):
            PeerConfig(advertise_addr=bad)
    wild = PeerConfig(bind_host="0.0.0.0", cluster_token="t" * 32)
    monkeypatch.setattr(config_mod, "_route_source", lambda family: "10.9.8.7")
    assert wild.advertised_host() == "10.9.8.7"
    # No default route: the hostname's address, but never loopback; else a clear error.
    monkeypatch.setattr(config_mod, "_route_source", lambda family: None)
    monkeypatch.setattr(config_mod.socket, "gethostname", lambda: "localhost")
    with pytest.raises(ConfigError, match="--advertise-addr"):
        wild.advertised_host()

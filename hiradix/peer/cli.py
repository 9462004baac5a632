"""``hiradix peer``: run a peer-cache node, or ask one how it is doing.

    hiradix peer serve --config peer.toml                  # settings from a file
    hiradix peer serve --rpc-port 7000 --pool-size 8GiB     # the first node is the head
    hiradix peer serve --join 10.0.0.1:7000 --join 10.0.0.2:7000
    hiradix peer status --node 127.0.0.1:7000 [--json]

``serve`` prints one JSON line with the node's addresses once it is up (``node_id``,
``rpc``, ``data``, ``metrics``, ``members``, ``masters``, ``ready``), then runs until
SIGINT/SIGTERM or ``--lifetime`` seconds, logging to stderr (membership changes, refused
cluster tokens; ``--log-level``). A node given ``--join``/``--discovery-addr`` must join:
if no seed answers within ``--join-timeout`` (or every seed refuses the cluster token) it
exits with status 1 and says why, unless ``--allow-alone``. Flags override the config file.
The cluster token comes from ``cluster_token`` in the config, ``--token-file``, or
``$HIRADIX_CLUSTER_TOKEN``.

Wire into the top-level ``hiradix`` command with :func:`add_subparsers`.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from hiradix import envvars

__all__ = ["add_subparsers", "build_parser", "main"]

_DESCRIPTION = """Run a peer-cache node, or ask one how it is doing.

examples:
  hiradix peer serve --config peer.toml                  # settings from a file
  hiradix peer serve --rpc-port 7000 --pool-size 8GiB     # the first node is the head
  hiradix peer serve --join 10.0.0.1:7000 --join 10.0.0.2:7000
  hiradix peer status --node 127.0.0.1:7000 [--json]

The cluster token comes from cluster_token in the config, --token-file, or
$HIRADIX_CLUSTER_TOKEN. Listeners bind to 127.0.0.1 unless --bind says otherwise; with
--bind 0.0.0.0 other nodes are told the address of the default route's interface
unless --advertise-addr names another. A node restarted with the command it was started
with rejoins its cluster (the members remember it)."""


def _add_serve(commands: Any) -> None:
    p = commands.add_parser(
        "serve",
        help="run one peer-cache node (RPC, directory shard, discovery, transport, metrics)",
        description="Run one peer-cache node until SIGINT/SIGTERM (or --lifetime).",
    )
    p.add_argument("--config", type=Path, help="a .json or .toml PeerConfig file")
    p.add_argument("--node-id", help="id on the ring (default: host:rpc_port)")
    p.add_argument("--bind", dest="bind_host", help="bind address of every listener (default 127.0.0.1)")
    p.add_argument(
        "--advertise-addr",
        dest="advertise_addr",
        metavar="HOST",
        help="host other nodes reach this one at (default: the bind address; for 0.0.0.0 the default route's)",
    )
    p.add_argument("--rpc-port", type=int, help="control-plane port (0: any)")
    p.add_argument("--data-port", type=int, help="TCP data-plane port (0: any)")
    p.add_argument(
        "--transport",
        choices=("auto", "tcp", "rdma"),
        help="data plane: rdma (fails without an ACTIVE RDMA port), tcp, or auto: rdma where it can run, "
        "else tcp (the default; the log says which and why)",
    )
    p.add_argument("--discovery-addr", help="host:port of the head master (default: this node is the head)")
    p.add_argument(
        "--join", action="append", default=[], metavar="HOST:PORT", help="another master to join through (repeat)"
    )
    p.add_argument("--join-timeout", dest="join_timeout_s", type=float, help="seconds to keep trying the seeds (30)")
    p.add_argument(
        "--allow-alone", action="store_true", help="if no seed can be joined, run alone (a WARNING) instead of failing"
    )
    p.add_argument("--pool-size", help="published pool bytes, e.g. 8GiB")
    p.add_argument("--page-size", help="page bytes (one slot), e.g. 64KiB")
    p.add_argument("--replicas", dest="directory_replicas", type=int, help="directory replicas per key")
    p.add_argument("--max-masters", type=int, help="active discovery masters")
    p.add_argument("--disk-path", help="enable the disk tier in this directory")
    p.add_argument("--disk-size", help="disk tier bytes, e.g. 100GB")
    p.add_argument("--metrics-port", type=int, help="metrics HTTP port (0: any)")
    p.add_argument("--no-metrics", action="store_true", help="do not run the metrics server")
    p.add_argument("--token-file", type=Path, help="file holding the cluster token")
    p.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat period in seconds (default 1)")
    p.add_argument("--lifetime", type=float, help="exit after this many seconds (tests, demos)")
    p.add_argument("--data-rpc", action="store_true", help="also serve page_put/page_get over RPC (operators, tests)")
    p.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="(INFO)"
    )
    p.set_defaults(run=run_serve)


def _add_status(commands: Any) -> None:
    p = commands.add_parser(
        "status",
        help="membership, pool, disk and hit rate of a running node",
        description="Ask a node (its RPC address) for its status.",
    )
    p.add_argument("--node", required=True, metavar="HOST:PORT", help="RPC address of any node")
    p.add_argument("--token-file", type=Path, help="file holding the cluster token")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds before giving up (default 5)")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.set_defaults(run=run_status)


def add_subparsers(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``peer`` (with ``serve`` and ``status``) to a parent ``add_subparsers()`` object."""
    peer = subparsers.add_parser(
        "peer",
        help="run or inspect a peer-cache node",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = peer.add_subparsers(dest="peer_command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_status(commands)
    return peer


def build_parser() -> argparse.ArgumentParser:
    """The standalone parser: ``python -m hiradix.peer.cli serve|status ...``."""
    parser = argparse.ArgumentParser(
        prog="hiradix peer", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="peer_command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_status(commands)
    return parser


def _token(args: argparse.Namespace, configured: str | None = None) -> str | None:
    if getattr(args, "token_file", None) is not None:
        return args.token_file.read_text(encoding="utf-8").strip()
    return configured or envvars.text("HIRADIX_CLUSTER_TOKEN")


def _config(args: argparse.Namespace) -> Any:
    from hiradix.peer.config import PeerConfig

    data: dict[str, Any] = PeerConfig.from_file(args.config).to_dict() if args.config else {}
    for name in (
        "node_id",
        "bind_host",
        "advertise_addr",
        "join_timeout_s",
        "rpc_port",
        "data_port",
        "transport",
        "discovery_addr",
        "pool_size",
        "page_size",
        "directory_replicas",
        "max_masters",
        "disk_path",
        "disk_size",
        "metrics_port",
    ):
        v = getattr(args, name, None)
        if v is not None:
            data[name] = v
    if args.disk_path:
        data["disk_enabled"] = True
    if args.no_metrics:
        data["metrics_enabled"] = False
    tok = _token(args, data.get("cluster_token"))
    if tok:
        data["cluster_token"] = tok
    return PeerConfig.from_dict(data)


def run_serve(args: argparse.Namespace) -> int:
    from hiradix.peer.config import ConfigError
    from hiradix.peer.membership import JoinError
    from hiradix.peer.node import PeerNode

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True
    )
    log = logging.getLogger("hiradix.peer.serve")
    try:
        cfg = _config(args)
    except (ConfigError, OSError) as exc:
        print(f"hiradix peer serve: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        node = PeerNode(cfg, seeds=args.join, heartbeat_s=args.heartbeat, allow_alone=args.allow_alone)
    except JoinError as exc:
        print(f"hiradix peer serve: cannot join the cluster: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"hiradix peer serve: cannot start: {exc}", file=sys.stderr)
        return 1
    try:
        if args.data_rpc:
            node.enable_data_rpc()
        st = node.status()
        log.info(
            "serving %s (rpc %s, data %s, incarnation %d); members: %s; ready: %s",
            st["node_id"],
            st["rpc"],
            st["data"],
            st["incarnation"],
            ", ".join(st["members"]),
            st["ready"],
        )
        keys = ("node_id", "rpc", "data", "metrics", "members", "masters", "ready")
        print(json.dumps({k: st[k] for k in keys}), flush=True)
        stop.wait(args.lifetime)
    finally:
        log.info("stopping %s", node.node_id)
        node.close()
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def run_status(args: argparse.Namespace) -> int:
    from hiradix.net.rpc import RpcClient

    try:
        with RpcClient(_token(args), timeout=args.timeout) as client:
            st = client.call(args.node, "node_status")
    except (ValueError, OSError) as exc:
        print(f"hiradix peer status: {args.node}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # an RpcError reply
        print(f"hiradix peer status: {args.node}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    pool = st["pool"]
    lines = [
        f"node        {st['node_id']}  (rpc {st['rpc']}, data {st['data']} over {st['transport']})",
        f"members     {len(st['members'])}: {', '.join(st['members'])}",
        f"masters     {', '.join(st['masters'])}" + ("  [no master reachable: cached view]" if st["frozen"] else ""),
        f"ready       {'yes' if st['ready'] else 'no: the directory share is still being pulled'}",
        f"pool        {pool['pages']} pages, {_fmt_bytes(pool['used_bytes'])} of "
        f"{_fmt_bytes(pool['capacity_bytes'])}, {pool['evictions']} evictions",
        "disk        off"
        if st["disk"] is None
        else f"disk        {st['disk']['pages']} pages, {_fmt_bytes(st['disk']['used_bytes'])} of "
        f"{_fmt_bytes(st['disk']['capacity_bytes'])}",
        f"directory   {st['directory_entries']} entries held, {st['published']} pages published here",
        f"hit rate    {st['hit_rate']:.3f}  ({st['stale_reads']} stale reads rejected)",
    ]
    if st.get("metrics"):
        lines.append(f"metrics     {st['metrics']}/metrics")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hiradix peer ...`` as a standalone entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())

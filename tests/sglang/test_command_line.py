"""The server flags README and docs/ (sglang/, storage.md) document, through the installed
SGLang's own command line (every SGLang venv): what they print is accepted as printed, and
what SGLang's parser refuses fails (:mod:`tests.sglang.args`)."""

from __future__ import annotations

import json

import pytest

from tests.sglang import require_sglang
from tests.sglang.args import ParserRefused, parse

require_sglang()

BASE = ["--model-path", "dummy", "--device", "cpu"]
#: README's "Use it in SGLang" command, and the storage flags of docs/storage.md.
HEADLINE = [
    "--enable-hierarchical-cache",
    "--radix-cache-backend",
    "hiradix",
    "--hicache-ratio",
    "2",
    "--hicache-mem-layout",
    "page_first",
    "--hicache-write-policy",
    "write_through",
]
STORAGE = {
    name: [
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(
            {
                "backend_name": f"hiradix-{name}",
                "module_path": "hiradix.sglang.storage",
                "class_name": cls,
                "interface_v1": 1,
                **more,
            }
        ),
    ]
    for name, cls, more in (
        ("peer", "PeerStorage", {"discovery_addr": "10.0.0.1:7000", "pool_size": "8GiB"}),
        ("file", "FileStorage", {"path": "/data/hicache"}),
        ("memory", "MemoryStorage", {"capacity_bytes": 8589934592}),
    )
}


def test_readmes_flags_pass_as_printed() -> None:
    args = parse([*BASE, *HEADLINE])
    assert (args.radix_cache_backend, args.hicache_mem_layout) == ("hiradix", "page_first")
    for name, flags in STORAGE.items():
        args = parse([*BASE, *HEADLINE, *flags])
        assert args.hicache_storage_backend == "dynamic", name
        assert json.loads(args.hicache_storage_backend_extra_config)["backend_name"] == f"hiradix-{name}"


def test_hiradix_only_names_are_refused_by_sglangs_parser() -> None:
    """docs/sglang/options.md says so: ``memory``, ``peer`` and ``sglang:NAME`` work only where
    ``ServerArgs`` is built in Python; on a command line, ``dynamic`` (above)."""
    for name in ("peer", "memory", "sglang:file"):
        with pytest.raises(ParserRefused, match="invalid choice"):
            parse([*BASE, *HEADLINE, "--hicache-storage-backend", name])

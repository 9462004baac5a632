"""Every environment variable hiradix reads, in one table, and the only reads of them.

Each variable is an :class:`EnvVar`: its name, its kind, its default, what it does and
where it applies (``runtime``: the installed package reads it; ``build``: ``setup.py``;
``test``: the test suite; ``bench``: the benchmark scripts). Code in :mod:`hiradix` reads
its variables through the getters here (:func:`flag`, :func:`text`, :func:`path`), never
through ``os.environ``; a test keeps it so. ``setup.py``, the tests and the benchmark
scripts read theirs directly (``setup.py`` cannot import the package it builds), but
they are listed here all the same, so that the documentation's table
(``docs/environment.md``, rendered from :func:`markdown_table`) is complete.

A ``flag`` reads as on or off: unset or empty means its default, ``0`` means off, any
other value means on.

This module imports nothing from hiradix (``setup.py`` and the documentation build load
it by path).

>>> flag("HIRADIX_PREFAULT", {})
True
>>> flag("HIRADIX_PREFAULT", {"HIRADIX_PREFAULT": "0"})
False
>>> flag("HIRADIX_PUREPYTHON", {"HIRADIX_PUREPYTHON": "yes"})
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KINDS", "SCOPES", "VARIABLES", "EnvVar", "flag", "lookup", "markdown_table", "path", "text"]

#: What a variable's value is: ``flag`` (on/off, see the module's docstring), ``tristate``
#: (unset: decide by what is found; ``0``: never; ``1``: always, failing if it cannot),
#: ``text``, ``path``, ``int``, ``float``.
KINDS = ("flag", "tristate", "text", "path", "int", "float")
#: Who reads it, in the order the documentation's table lists them.
SCOPES = ("runtime", "build", "test", "bench")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``default`` is as the reader takes it when unset
    (``None``: no value); ``read_in`` names the files that read it."""

    name: str
    kind: str
    default: str | None
    scope: str
    meaning: str
    read_in: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.scope not in SCOPES:
            raise ValueError(f"{self.name}: scope {self.scope!r} is not one of {SCOPES}")


VARIABLES: tuple[EnvVar, ...] = (
    # ------------------------------------------------------------------ runtime
    EnvVar("HIRADIX_PUREPYTHON", "flag", "0", "runtime",
           "Use the pure-Python twin of every compiled module (the tree, the row copy, the peer "
           "cache's hashing and slot checks, the TCP data plane, the SGLang match and insert). "
           "At build time, build no extension at all.",
           "hiradix/_native.py, setup.py, tests/support/__init__.py"),
    EnvVar("HIRADIX_TRACE", "path", None, "runtime",
           "The Mooncake-format trace `hiradix sim`, `sweep` and `plan` replay when no `--trace` is given "
           "(the Azure traces are looked up in the same folder). Unset: the full trace in `../shared/traces/` "
           "beside a source checkout, else the 1,000-request excerpt installed with the package.",
           "hiradix/cli.py, .ci/test"),
    EnvVar("HIRADIX_CLUSTER_TOKEN", "text", None, "runtime",
           "The peer cluster's shared secret (at least 16 bytes) for the HMAC handshake of every "
           "connection. A config's `cluster_token` or `--token-file` takes precedence.",
           "hiradix/net/auth.py, hiradix/peer/cli.py, hiradix/peer/config.py"),
    EnvVar("HIRADIX_BATCH_BACKUPS", "flag", "1", "runtime",
           "Start the write-through backups of a scheduler step's inserts together, at the step's "
           "`check_hicache_events()`. `0`: start each insert's backups inside the insert, as SGLang does.",
           "hiradix/sglang/builder.py"),
    EnvVar("HIRADIX_HUGEPAGES", "flag", "1", "runtime",
           "Back CPU KV pools of 2 MiB or more with transparent huge pages (Linux). `0`: 4 KiB pages.",
           "hiradix/memory/pools.py"),
    EnvVar("HIRADIX_PREFAULT", "flag", "1", "runtime",
           "Fault huge-page pools in when they are made, at start-up. `0`: leave the faults to first use "
           "(each may then compact memory on the scheduler thread).",
           "hiradix/memory/pools.py"),
    EnvVar("HIRADIX_CUDA_KERNEL", "flag", "1", "runtime",
           "`CudaCopyEngine` moves KV with hiradix's CUDA gather/scatter kernel wherever the library "
           "loads on a CUDA device (the fastest path measured). `0`: the torch path instead.",
           "hiradix/memory/kernel.py"),
    EnvVar("HIRADIX_CUDA_KERNEL_MODE", "text", "wide", "runtime",
           "How the kernel shares a copy among threads: `wide` (many blocks, chunks striped over every "
           "thread; the mode measured on an H200) or `warp` (a few blocks, a warp per row, streaming "
           "loads and stores: made to leave the SMs to the forward pass; not yet measured on a GPU).",
           "hiradix/memory/kernel.py"),
    EnvVar("HIRADIX_SGLANG_ANY_VERSION", "flag", "0", "runtime",
           "Let the SGLang plugin and adapter load on an SGLang version they do not support.",
           "hiradix/_sglang_versions.py"),
    # ------------------------------------------------------------------ build
    EnvVar("HIRADIX_CYTHON_DEBUG", "flag", "0", "build",
           "Build the extensions with bounds checks, initialized checks and line tracing, at -O0 -g.",
           "setup.py"),
    EnvVar("HIRADIX_ANNOTATE", "flag", "0", "build",
           "Write Cython's annotated HTML next to each `.pyx`.", "setup.py"),
    EnvVar("HIRADIX_CUDA", "tristate", None, "build",
           "Build the CUDA copy kernel `libhiradix_kvcopy.so`: unset, where `nvcc` is found; `0`, never; "
           "`1`, or fail the build.",
           "setup.py"),
    EnvVar("HIRADIX_CUDA_ARCHS", "text", "80;90;100", "build",
           "GPU architectures the CUDA kernel is compiled for (`;`-separated), plus PTX of the last.",
           "setup.py"),
    EnvVar("HIRADIX_VERBS", "tristate", None, "build",
           "Build the libibverbs binding `hiradix.transport._verbs`: unset, where `infiniband/verbs.h` is "
           "found; `0`, never; `1`, or fail the build.",
           "setup.py"),
    EnvVar("CUDA_HOME", "path", "/usr/local/cuda", "build",
           "Where to look for `nvcc` when it is not on `PATH` (`CUDA_PATH` is read too).", "setup.py"),
    EnvVar("CPATH", "text", None, "build",
           "Extra include folders searched for `infiniband/verbs.h`.", "setup.py"),
    # ------------------------------------------------------------------ test
    EnvVar("HIRADIX_STRESS_SCALE", "float", "1", "test",
           "Multiplies the number of operations of the randomized stress tests.", "tests/tree/test_stress.py"),
    EnvVar("HIRADIX_PARITY_MAX_EXAMPLES", "int", "6", "test",
           "Hypothesis examples of the stateful parity test (compiled tree against the twin).",
           "tests/tree/test_parity_stateful.py"),
    EnvVar("HIRADIX_PARITY_STEPS", "int", "50", "test",
           "Steps per example of the stateful parity test.", "tests/tree/test_parity_stateful.py"),
    EnvVar("HIRADIX_PARITY_SELFTEST", "flag", "0", "test",
           "Run the parity helpers against themselves (checks that the tests can fail).", "tests/support/__init__.py"),
    EnvVar("REQUIRE_RDMA", "flag", "0", "test",
           "Fail, instead of skipping, the transport conformance suite's `rdma` case where no ACTIVE RDMA "
           "port is found.",
           "tests/transport/test_conformance.py"),
    EnvVar("HIRADIX_E2E_SLOW_LOAD_S", "float", "0", "test",
           "Set by the real-server tests for the server they start: seconds each load back is delayed, so "
           "that a forward pass that does not wait for the layer-done counter reads unloaded KV.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_SLOW_PEER_READ_S", "float", "0", "test",
           "Set by the real-server tests for the peer they kill mid-read: seconds each remote READ its "
           "peer node serves over TCP stalls (pages pinned) after saying so in the log.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_STALL_AFTER_FINISH_S", "float", "0", "test",
           "Set by the real-server ordering tests: under the overlap scheduler, after a result in which a "
           "request finished, the scheduler waits (at most this long) for the next request to arrive.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_NAIVE_PAGED_ALLOC", "flag", "0", "test",
           "Set by the real-server tests for page sizes above 1: SGLang 0.5.18/0.5.20's paged allocator "
           "runs its naive CPU path in place of its Triton kernels, which have no CPU driver.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_STOCK_ON_CPU", "flag", "0", "test",
           "Set by the real-server tests and `bench/e2e_server.py`: install the CPU stand-ins that let "
           "stock SGLang's hierarchical cache run in a CPU server.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_PD_ON_CPU", "flag", "0", "test",
           "Set by the PD real-server tests for their prefill servers: SGLang 0.5.23's Mooncake KV sender "
           "takes its CPU index path, not the pinned-memory and CUDA-event one a CPU torch lacks.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_UNREGISTERED_COUNTER", "flag", "0", "test",
           "Set by the real-server tests for their control server: hiradix's layer-done counter is not "
           "registered with SGLang's KV pool, so that with slowed loads its outputs must be wrong.",
           "tests/e2e/inject/sitecustomize.py"),
    EnvVar("HIRADIX_E2E_REQUIRED", "flag", "0", "test",
           "Set by `.ci/test` for the real-server runs: a run of `tests/e2e` that collects no test, or "
           "in which none passes (every one skipped, say for a missing package), fails, saying why.",
           "tests/e2e/conftest.py"),
    # ------------------------------------------------------------------ bench
    EnvVar("HIRADIX_BENCH_VENVS", "path", ".bench-venvs", "bench",
           "Folder of the baseline venvs the benchmarks compare against (SGLang's trees for "
           "`bench/tree_ops.py`, made by `bench/setup_sglang.sh`; PeerCache and Mooncake for `bench/peer.py`). "
           "The default is in the checkout. `bench/setup_sglang.sh` also reads `SGLANG_018_VENV`, "
           "`SGLANG_023_VENV`, `SGLANG_STUBS` and `PYTHON` for single paths.",
           "bench/tree_ops.py, bench/peer.py, bench/setup_sglang.sh"),
    EnvVar("PEERCACHE_PYTHON", "path", "$HIRADIX_BENCH_VENVS/peercache/bin/python", "bench",
           "The Python with PeerCache installed, for `bench/peer.py`'s comparison.", "bench/peer.py"),
    EnvVar("MOONCAKE_PYTHON", "path", "$HIRADIX_BENCH_VENVS/mooncake/bin/python", "bench",
           "The Python with Mooncake installed, for `bench/peer.py`'s comparison.", "bench/peer.py"),
    EnvVar("MOONCAKE_MASTER_LOG", "path", "/tmp/mooncake_master.log", "bench",
           "Log file of the `mooncake_master` that `bench/peer_others.py` starts.", "bench/peer_others.py"),
    EnvVar("TESTS_TIMEOUT", "int", "180", "bench",
           "Seconds `bench/gpu/run.sh` lets the CUDA tests of the copy path run.", "bench/gpu/run.sh"),
    EnvVar("WAIT_TIMEOUT", "int", "200", "bench",
           "Seconds `bench/gpu/run.sh` lets `bench/layer_wait_gpu.py` run.", "bench/gpu/run.sh"),
    EnvVar("TRANSFER_TIMEOUT", "int", "200", "bench",
           "Seconds `bench/gpu/run.sh` lets `bench/transfer_gpu.py` run.", "bench/gpu/run.sh"),
    EnvVar("SUITE_TIMEOUT", "int", "400", "bench",
           "Seconds `bench/gpu/suite.sh` lets the test suite run on a GPU machine.", "bench/gpu/suite.sh"),
    EnvVar("SUITE_WORKERS", "int", "12", "bench",
           "pytest-xdist workers of `bench/gpu/suite.sh`.", "bench/gpu/suite.sh"),
)  # fmt: skip

_BY_NAME = {v.name: v for v in VARIABLES}


def lookup(name: str) -> EnvVar:
    """The registered variable ``name``; ``KeyError`` for a name not in :data:`VARIABLES`
    (a new variable is added there first). Runtime complexity: ``O(1)``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not registered in hiradix.envvars.VARIABLES") from None


def _raw(name: str, kind: str, environ: Mapping[str, str] | None) -> str | None:
    var = lookup(name)
    if var.kind != kind:
        raise TypeError(f"{name} is a {var.kind}, not a {kind}")
    value = (os.environ if environ is None else environ).get(name)
    return value if value else None  # empty is unset


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A ``flag``'s value, read now: unset or empty, its default; ``0``, off; else on.

    >>> flag("HIRADIX_CUDA_KERNEL", {"HIRADIX_CUDA_KERNEL": "1"})
    True
    """
    value = _raw(name, "flag", environ)
    if value is None:
        value = lookup(name).default or "0"
    return value != "0"


def text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """A ``text`` variable's value, read now; its default when unset or empty.

    >>> text("HIRADIX_CLUSTER_TOKEN", {}) is None
    True
    """
    value = _raw(name, "text", environ)
    return lookup(name).default if value is None else value


def path(name: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """A ``path`` variable's value, read now, or ``None`` when unset or empty (the caller
    applies its default, which may be relative to something other than the working folder).

    >>> path("HIRADIX_TRACE", {"HIRADIX_TRACE": "/data/t.jsonl"})
    PosixPath('/data/t.jsonl')
    """
    value = _raw(name, "path", environ)
    return None if value is None else Path(value)


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def markdown_table(scopes: tuple[str, ...] = SCOPES) -> str:
    """:data:`VARIABLES` as one Markdown table, by scope, for the documentation.

    >>> markdown_table(("runtime",)).splitlines()[0]
    '| variable | applies to | kind | default | what it does | read in |'
    """
    rows = [
        "| variable | applies to | kind | default | what it does | read in |",
        "|---|---|---|---|---|---|",
    ]
    for scope in scopes:
        for v in VARIABLES:
            if v.scope != scope:
                continue
            default = "(unset)" if v.default is None else f"`{v.default}`"
            where = ", ".join(f"`{w.strip()}`" for w in v.read_in.split(","))
            rows.append(f"| `{v.name}` | {scope} | {v.kind} | {_cell(default)} | {_cell(v.meaning)} | {where} |")
    return "\n".join(rows) + "\n"

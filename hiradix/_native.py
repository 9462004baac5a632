"""The one convention for compiled modules and their pure-Python twins.

Every compiled module is ``hiradix/<layer>/_<name>.pyx``, built under the dotted name
``hiradix.<layer>._<name>``, listed in :data:`TWINS` with the pure-Python code that gives
the same results in its place (its *twin*) and the test that runs both and compares them;
the README's table "Compiled modules and their twins" is this table. Its callers get it
only through :func:`load`, which answers ``None`` (the twin serves) when
``HIRADIX_PUREPYTHON=1`` is set or the module was not built (installed without a compiler):
one switch, one place, for all of them.

How the modules were built is recorded beside them (:func:`build_info`, written by
``setup.py``) and checked against what is intended (:func:`build_problems`), so that every
install path (in place, editable, the wheel) is held to the same fast build.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from hiradix import envvars

__all__ = ["TWINS", "Twin", "build_info", "build_problems", "load", "pinned_cython", "pure_python"]


@dataclass(frozen=True)
class Twin:
    """One compiled module, its pure-Python twin and their parity test."""

    compiled: str  # dotted name of the compiled module
    twin: str | None  # dotted name of the module or function that serves in its place
    parity_test: str  # test file (repository-relative) that runs both and compares them
    note: str = ""  # how the twin is chosen where it is not a drop-in module


TWINS: tuple[Twin, ...] = (
    Twin(
        "hiradix.tree._core",
        "hiradix.tree._reference",
        "tests/tree/test_parity_stateful.py",
        "same API, module for module; every tree_cls test runs both",
    ),
    Twin(
        "hiradix.tree._unified",
        "hiradix.tree.unified",
        "tests/tree/test_unified_parity.py",
        "same API, module for module; SGLang 0.5.23's tree core runs on either",
    ),
    Twin(
        "hiradix.memory._gather",
        "hiradix.memory.copy._backup_layer",
        "tests/memory/test_gather.py",
        "the torch row copies of the copy engine and the pools",
    ),
    Twin(
        "hiradix.memory._kvcopy_emu",
        "hiradix.memory.copy._backup_layer",
        "tests/memory/test_kernel.py",
        "CPU emulation of the CUDA kernel, checked against the torch path it replaces",
    ),
    Twin("hiradix.peer._hash", "hiradix.peer.keyhash._key_digests_py", "tests/peer/test_keyhash.py", "hashlib per key"),
    Twin(
        "hiradix.peer._verify",
        "hiradix.peer.pool.verify_parts",
        "tests/peer/test_store.py",
        "per-slot loop in hiradix.peer.reader",
    ),
    Twin(
        "hiradix.transport._tcpio",
        "hiradix.transport.tcp.read_frames_py",
        "tests/transport/test_specific.py",
        "TcpTransport(native=False): the same bytes through socket calls",
    ),
    Twin(
        "hiradix.sglang._match",
        "hiradix.sglang.cache.HiRadixCacheBase.match_prefix",
        "tests/sglang/test_match_compiled.py",
        "the Python method; the compiled one serves plain keys, on the instance",
    ),
    Twin(
        "hiradix.sglang._insert",
        "hiradix.sglang.cache.HiRadixCacheBase.insert",
        "tests/sglang/test_insert_compiled.py",
        "the Python method; the compiled one serves the scheduler's calls, on the instance",
    ),
    Twin(
        "hiradix.transport._verbs",
        None,
        "tests/transport/test_rdma.py",
        "no twin: RDMA needs the NIC; the RDMA transport reports why it is unavailable",
    ),
)

_NAMES = frozenset(t.compiled for t in TWINS)


def pure_python() -> bool:
    """Whether ``HIRADIX_PUREPYTHON`` asks for the pure-Python twins everywhere."""
    return envvars.flag("HIRADIX_PUREPYTHON")


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``"hiradix.peer._hash"``), or ``None`` when the
    pure-Python twin must serve: ``HIRADIX_PUREPYTHON`` is set or it was not built.
    ``ValueError`` for a name :data:`TWINS` does not list (a compiled module has a twin
    and a parity test, or it is not loaded)."""
    if name not in _NAMES:
        raise ValueError(f"{name} is not a compiled module listed in hiradix._native.TWINS")
    if pure_python():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # no compiler at install time: the twin serves
        return None


# ----------------------------------------------------------------------------- the build
BUILD_INFO = "_build.json"  # setup.py's BuildExt writes it beside this module
OPTIMIZATION = "-O3"


def build_info() -> dict[str, Any] | None:
    """What the compiled modules were built with: per module, the Cython that generated its
    C (``cython``) and the compiler command's flags (``command``); also ``debug``
    (``HIRADIX_CYTHON_DEBUG``), the build's numpy and Python. ``None`` where nothing was
    compiled here (a pure-Python install)."""
    try:
        return json.loads(Path(__file__).with_name(BUILD_INFO).read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


def pinned_cython(build_requires: Iterable[str]) -> str:
    """The one Cython version pyproject.toml's ``[build-system] requires`` pins
    (``Cython==X``); ``ValueError`` if it is not pinned to exactly one."""
    for req in build_requires:
        found = re.fullmatch(r"\s*cython\s*==\s*([\w.]+)\s*", req, re.IGNORECASE)
        if found:
            return found.group(1)
    raise ValueError(f"[build-system] requires does not pin Cython to one version (Cython==X): {list(build_requires)}")


def build_problems(info: dict[str, Any], cython: str, modules: Iterable[str] = ()) -> list[str]:
    """How a build (:func:`build_info`) differs from the intended one: every module
    generated by Cython ``cython`` and compiled with ``-O3`` as the last optimisation flag
    the compiler reads (any level in a debug build), and each of ``modules`` (dotted
    names) recorded. Empty: as intended."""
    problems = [f"{name}: not in the build's record" for name in modules if name not in info["extensions"]]
    for name, ext in sorted(info["extensions"].items()):
        if ext["cython"] != cython:
            problems.append(f"{name}: its C was generated by Cython {ext['cython']}, not {cython}")
        levels = [flag for flag in ext["command"] if re.fullmatch(r"-O\w*", flag)]
        if not info["debug"] and (not levels or levels[-1] != OPTIMIZATION):
            problems.append(f"{name}: compiled at {levels[-1] if levels else 'no -O flag'}, not {OPTIMIZATION}")
    return problems

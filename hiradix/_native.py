"""Which compiled extensions to use: all of them, unless ``HIRADIX_PUREPYTHON=1`` is set or
the package was installed without a compiler. Every compiled module has a pure-Python twin
giving the same results; the callers pick between them with :func:`load`."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load", "pure_python"]


def pure_python() -> bool:
    """Whether ``HIRADIX_PUREPYTHON`` asks for the pure-Python twins everywhere."""
    return os.environ.get("HIRADIX_PUREPYTHON", "") not in ("", "0")


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` (e.g. ``"hiradix.peer._hash"``), or ``None`` when the
    pure-Python twin must serve: ``HIRADIX_PUREPYTHON`` is set or it was not built."""
    if pure_python():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # no compiler at install time: the msgpack-style fallback
        return None

"""The simulator's optional dependencies, the ``sim`` extra (``pip install 'hiradix[sim]'``):
tqdm for progress bars and matplotlib for figures.

hiradix is loaded into every SGLang server that uses it, and only the simulator draws or
shows progress, so neither is a dependency of the package: each is imported here on first
use, and a missing one is an :class:`ImportError` that says what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["INSTALL", "figure", "progress_bar"]

INSTALL = "pip install 'hiradix[sim]'"


def _need(module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        dist = module.split(".")[0]
        raise ImportError(f"the simulator's {what} need {dist}, which is not installed: {INSTALL}") from exc


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """``tqdm.tqdm(*args, **kwargs)``. ``ImportError`` (saying what to install) without tqdm."""
    return _need("tqdm", "progress bars").tqdm(*args, **kwargs)


def figure(**kwargs: Any) -> Any:
    """``matplotlib.figure.Figure(**kwargs)``. ``ImportError`` (saying what to install)
    without matplotlib."""
    return _need("matplotlib.figure", "plots").Figure(**kwargs)

"""SGLang's plugin entry point for hiradix (group ``sglang.srt.plugins``), and the SGLang versions
hiradix.sglang supports.

Outside :mod:`hiradix.sglang` on purpose: SGLang loads every installed plugin at start-up,
also when ``--radix-cache-backend hiradix`` is not asked for, so an unsupported SGLang
must cost a warning here, not a failed start. ``--radix-cache-backend hiradix`` then fails
with SGLang's "not registered" error, and importing :mod:`hiradix.sglang` says why.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

__all__ = ["SUPPORTED_VERSIONS", "TESTED_VERSIONS", "UnsupportedSGLang", "check_sglang_version", "register"]

logger = logging.getLogger(__name__)

#: Versions whose scheduler, pools and ``register_radix_cache_backend`` the adapter is
#: written against (0.5.15 added the radix-cache registry; 0.5.18 is the last release whose
#: default hierarchical cache is its own HiRadixCache; 0.5.20 keeps 0.5.18's request calls
#: on a new request record; 0.5.23 has a new request API: :mod:`hiradix.sglang.api`).
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.20", "0.5.23")
#: Versions CI runs SGLang tests on (0.5.18 and 0.5.20: ``tests/sglang``, see the README
#: for which of them run on 0.5.20; 0.5.23: ``tests/sglang23``).
TESTED_VERSIONS: tuple[str, ...] = ("0.5.18", "0.5.20", "0.5.23")

_OVERRIDE = "HIRADIX_SGLANG_ANY_VERSION"


class UnsupportedSGLang(ImportError):
    """SGLang is missing, or its version is not one :mod:`hiradix.sglang` supports."""


def check_sglang_version() -> str:
    """The installed SGLang's version; raises :class:`UnsupportedSGLang` naming the
    supported versions when SGLang is missing or another version (set
    ``HIRADIX_SGLANG_ANY_VERSION=1`` to try an unsupported one anyway)."""
    want = ", ".join(SUPPORTED_VERSIONS)
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise UnsupportedSGLang(
            f"hiradix.sglang needs SGLang ({want}); it is not installed: pip install 'sglang=={SUPPORTED_VERSIONS[-1]}'"
        ) from None
    base = version.split("+")[0]
    if base not in SUPPORTED_VERSIONS and os.environ.get(_OVERRIDE, "") in ("", "0"):
        raise UnsupportedSGLang(
            f"hiradix.sglang supports SGLang {want} (tested: {', '.join(TESTED_VERSIONS)}); "
            f"SGLang {version} is installed. Set {_OVERRIDE}=1 to try it anyway."
        )
    return version


def register() -> None:
    """Register hiradix as SGLang's radix-cache backend ``hiradix`` if this SGLang is
    supported; otherwise log why not."""
    try:
        check_sglang_version()
    except UnsupportedSGLang as e:
        logger.warning("hiradix plugin not registered: %s", e)
        return
    from hiradix.sglang.plugin import register as register_backend

    register_backend()

"""SGLang's plugin entry point for hiradix (group ``sglang.srt.plugins``).

Outside :mod:`hiradix.sglang` on purpose: SGLang loads every installed plugin at start-up,
also when ``--radix-cache-backend hiradix`` is not asked for, so an unsupported SGLang
must cost a warning here, not a failed start. ``--radix-cache-backend hiradix`` then fails
with SGLang's "not registered" error, and importing :mod:`hiradix.sglang` says why
(:mod:`hiradix._sglang_versions`).
"""

from __future__ import annotations

import logging

from hiradix._sglang_versions import UnsupportedSGLang, check_sglang_version

__all__ = ["register"]

logger = logging.getLogger(__name__)


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

"""Registration with SGLang's radix-cache registry (the plugin entry point)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND_NAME", "create_cache", "register"]

logger = logging.getLogger(__name__)

#: The name to pass to ``--radix-cache-backend``.
BACKEND_NAME = "hiradix"


def create_cache(ctx: Any) -> Any:
    """SGLang's ``RadixCacheFactory`` for hiradix: what SGLang's built-in hierarchical
    branch does, with hiradix's cache. Needs ``--enable-hierarchical-cache``; refuses
    hybrid (SWA, Mamba) and DSA models, which hiradix does not cache."""
    from hiradix.sglang.api import HiRadixCache

    if not ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend hiradix needs --enable-hierarchical-cache")
    if ctx.disable_radix_cache:
        raise ValueError("--radix-cache-backend hiradix cannot be used with --disable-radix-cache")
    for flag, what in (("is_hybrid_swa", "sliding-window (SWA)"), ("is_hybrid_ssm", "Mamba/SSM"), ("is_dsa", "DSA")):
        if getattr(ctx, flag, False):
            raise ValueError(f"--radix-cache-backend hiradix does not support {what} models")
    cache = HiRadixCache(ctx.params, ctx.server_args)
    ctx.tp_worker.register_hicache_layer_transfer_counter(cache.cache_controller.layer_done_counter)
    logger.info("hiradix: hierarchical radix cache on the %s core", _core_name())
    return cache


def _core_name() -> str:
    import hiradix

    return hiradix.IMPLEMENTATION


def register() -> None:
    """Register :func:`create_cache` as the radix-cache backend ``hiradix``. Idempotent:
    SGLang may load plugins once per process (main, scheduler, workers)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is create_cache:
        return
    register_radix_cache_backend(BACKEND_NAME, create_cache)

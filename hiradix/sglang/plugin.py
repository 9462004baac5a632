"""Registration with SGLang's radix-cache registry (the plugin entry point)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND_NAME", "create_cache", "register", "register_tree_core"]

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
    """Register :func:`create_cache` as the radix-cache backend ``hiradix``, and hiradix's
    tree core (:func:`register_tree_core`). Idempotent: SGLang may load plugins once per
    process (main, scheduler, workers)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is not create_cache:
        register_radix_cache_backend(BACKEND_NAME, create_cache)
    try:
        register_tree_core()
    except Exception:  # the cache backend above must serve whatever the tree core's import does
        logger.warning(
            "hiradix tree core not registered (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=hiradix will not be "
            "found); --radix-cache-backend hiradix is unaffected",
            exc_info=True,
        )


def register_tree_core() -> bool:
    """Register hiradix's tree core with SGLang's tree-core registry (0.5.23 on) under
    ``hiradix``, chosen by ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=hiradix``. Idempotent;
    ``False`` where this SGLang has no such registry or an interface older than 0.5.23's."""
    try:
        from sglang.srt.mem_cache.unified_cache import tree_core_registry as registry
        from sglang.srt.mem_cache.unified_cache import unified_tree_core_interface as interface
    except ImportError:  # no UnifiedRadixCache tree cores
        return False
    if not hasattr(interface, "TreePathNodeInfo"):  # 0.5.18's older interface: the core is written to 0.5.23's
        logger.info("hiradix tree core not registered: this SGLang's UnifiedTreeCoreInterface predates 0.5.23")
        return False
    from hiradix.sglang.tree_core import TREE_CORE_NAME, create_tree_core

    if registry.get_tree_core_factory(TREE_CORE_NAME) is not create_tree_core:
        registry.register_tree_core_backend(TREE_CORE_NAME, create_tree_core)
    return True

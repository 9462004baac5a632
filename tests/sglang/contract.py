"""What SGLang's own server code reads from the tree cache and its controller, found by
reading the installed SGLang's source (not by waiting for an ``AttributeError`` in a
server): every ``tree_cache.NAME`` and ``tree_cache.cache_controller.NAME`` (or
``cache_controller.NAME``) in its scheduler, its components, the tokenizer and detokenizer
managers, the metrics code and the HTTP entry points. The tests check hiradix's cache has
each name, or that the name is one of :data:`NOT_APPLICABLE`, which SGLang reaches only
for caches or options hiradix refuses at start-up (each entry says which). Shared by
``tests/sglang`` (0.5.18, 0.5.20) and ``tests/sglang/v23`` (0.5.23)."""

from __future__ import annotations

import ast
import importlib.util
from collections import defaultdict
from pathlib import Path

__all__ = ["NOT_APPLICABLE", "missing_names", "server_reads"]

#: Names SGLang reads only on paths hiradix's cache never takes, with the guard.
NOT_APPLICABLE: dict[str, str] = {
    # sliding-window (SWA) models: refused (check_supported)
    "dec_swa_lock_only": "SWA trees only",
    "sliding_window_size": "SWA trees only",
    "swa_retain_window": "SWA trees only",
    "release_swa_prefix_lock": "SWA trees only",
    "sanity_check": "the invariant checker calls it for SWA / Mamba trees only",
    # Mamba / SSM models: refused by the plugin's factory
    "all_mamba_values_flatten": "Mamba trees only",
    "mamba_evictable_size": "Mamba trees only",
    "mamba_protected_size": "Mamba trees only",
    # --enable-session-radix-cache: refused
    "open_radix_session": "session radix cache only",
    "ensure_session_generation": "session radix cache only",
    # 0.5.23: behind isinstance(tree_cache, UnifiedRadixCache)
    "components": "UnifiedRadixCache only (isinstance guard)",
    "host_pool_group": "UnifiedRadixCache only (isinstance guard)",
    "tree_core": "UnifiedRadixCache only (isinstance guard)",
    "linker": "UnifiedRadixCache only (isinstance guard)",
    "inc_host_lock_ref": "UnifiedRadixCache only (isinstance guard)",
    "dec_host_lock_ref": "UnifiedRadixCache only (isinstance guard)",
    "sidecar_pool_specs": "UnifiedRadixCache only (isinstance guard)",
    "buffer_pipeline": "--hicache-host-memory-mode buffer_only only: refused",
    "finish_external_linker_loads": "--enable-unified-cache-external-linker only: refused",
    "has_pending_cache_operations": "--enable-lmcache only: refused",
    "bind_prefetch_ticket": "PP prefetch tickets only: needs cache_controller.pp_prefetch_command_group, "
    "which hiradix's controller does not have (SGLang reads it with getattr)",
}

#: What SGLang reads from the controller where the reading code names it otherwise
#: (0.5.23's ``_hicache_l3_layout``: ``controller = tree_cache.cache_controller``).
CONTROLLER_ALWAYS = ("storage_backend", "storage_backend_type")


def _sglang_srt() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "SGLang is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


def server_reads() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(tree cache names, controller names)``, each name with the files that read it."""
    srt = _sglang_srt()
    cache: dict[str, set[str]] = defaultdict(set)
    controller: dict[str, set[str]] = defaultdict(set)
    for name in CONTROLLER_ALWAYS:
        controller[name].add("scheduler.py")
    for path in sorted(srt.rglob("*.py")):
        if not {"managers", "observability", "entrypoints"} & set(path.relative_to(srt).parts):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if (isinstance(value, ast.Attribute) and value.attr == "tree_cache") or (
                isinstance(value, ast.Name) and value.id == "tree_cache"
            ):
                cache[node.attr].add(path.name)
            elif (isinstance(value, ast.Attribute) and value.attr == "cache_controller") or (
                isinstance(value, ast.Name) and value.id == "cache_controller"
            ):
                controller[node.attr].add(path.name)
    return cache, controller


def missing_names(cache: object) -> list[str]:
    """What SGLang's server code reads that ``cache`` (or its ``cache_controller``) lacks
    and :data:`NOT_APPLICABLE` does not explain, as ``"tree_cache.NAME (files)"``."""
    reads, controller_reads = server_reads()
    assert len(reads) > 30, f"found only {sorted(reads)}: the scan no longer matches SGLang's code"
    out = [
        f"tree_cache.{name} ({', '.join(sorted(files))})"
        for name, files in sorted(reads.items())
        if name not in NOT_APPLICABLE and not hasattr(cache, name)
    ]
    controller = cache.cache_controller  # type: ignore[attr-defined]
    out += [
        f"tree_cache.cache_controller.{name} ({', '.join(sorted(files))})"
        for name, files in sorted(controller_reads.items())
        if not hasattr(controller, name)
    ]
    return out

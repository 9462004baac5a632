"""The builder's first half: SGLang's options read into hiradix's, and every option this
adapter does not honour refused at start-up with the option named, never silently ignored.

How a generation of SGLang's server hands its options over is a :class:`Server`: 0.5.15 to
0.5.18 (:data:`SERVER_V18`) and 0.5.20 on (:data:`SERVER_SINCE_020`: the options read
resolved, more of them to refuse, L3 prefetches with keyword arguments). The request-API
module of each generation names its own (:mod:`hiradix.sglang.api`).

L3 page format (``"l3_format"`` in ``--hicache-storage-backend-extra-config``):

``"hiradix"`` (default)
    Namespaced keys: every hash chain is seeded from the model (``--served-model-name``),
    ``--weight-version``, KV dtype, page byte layout, KV shape and TP/PP/CP shape, and a
    request's ``extra_key`` / ``cache_salt`` seed its own chain on top, so no other
    model's, version's or tenant's pages are ever served; MHA ranks under TP add
    ``_r{rank}``. Pages are hiradix's byte order (zero copy for page-first layouts).
``"sglang"``
    SGLang 0.5.18's keys and pages exactly: the token-only ``get_hash_str`` chain in every
    namespace (as SGLang, requests with other ``extra_key`` / ``cache_salt`` share L3
    pages of equal tokens, though never tree nodes), ``HiCacheFile``'s model and rank
    suffix (:func:`~hiradix.storage.keys.sglang_key_suffix`) and SGLang's flat host page
    for the layout, so this node and stock SGLang nodes of the same model, layout and
    parallel shape read each other's pages from one L3 (stock SGLang loads hiradix's
    backends through :mod:`hiradix.sglang.storage`).

Backup copies on CPU pools (``"backup_copy"`` in the extra config): ``"inline"`` (default)
copies a step's backups on the scheduler thread when they start, as SGLang does;
``"thread"`` hands them to a copy thread, which only pays off for a lot of KV per step.
Refused for GPU pools, whose copies run on a CUDA stream.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hiradix.cache.l3 import PREFETCH_POLICIES, PrefetchConfig
from hiradix.tree.policy import WRITE_POLICIES, policy_names

__all__ = [
    "BACKUP_COPIES",
    "L3_FORMATS",
    "SERVER_SINCE_020",
    "SERVER_V18",
    "ResolvedArgs",
    "Server",
    "check_supported",
    "check_supported_since_020",
    "parse_extra_config",
    "read_backup_copy",
    "read_l3_format",
    "read_prefetch",
]

L3_FORMATS = ("hiradix", "sglang")
BACKUP_COPIES = ("inline", "thread")
# SGLang's defaults for its L3 re-issue options; hiradix never re-issues (0 is the same).
_RETRY_DEFAULT = 8


def parse_extra_config(source: str | None) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config``: a JSON object, or ``@path`` to a JSON,
    TOML or YAML file, as SGLang 0.5.18 reads it. Raises ``ValueError`` naming the option."""
    if not source:
        return {}
    opt = "--hicache-storage-backend-extra-config"
    try:
        if source.startswith("@"):
            path = source[1:]
            ext = os.path.splitext(path)[1].lower()
            if ext == ".json":
                with open(path) as f:
                    data = json.load(f)
            elif ext == ".toml":
                if sys.version_info >= (3, 11):
                    import tomllib
                else:  # pragma: no cover - Python 3.10 (pyproject.toml installs tomli there)
                    import tomli as tomllib

                with open(path, "rb") as f:
                    data = tomllib.load(f)
            elif ext in (".yaml", ".yml"):
                import yaml

                with open(path) as f:
                    data = yaml.safe_load(f)
            else:
                raise ValueError(f"unsupported config file type {ext!r} (use .json, .toml or .yaml)")
        else:
            data = json.loads(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"{opt}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{opt} must be an object, got {type(data).__name__}")
    return data


def read_prefetch(extra: dict[str, Any], policy: str) -> tuple[PrefetchConfig, bool]:
    """Pop SGLang's prefetch keys from ``extra`` (threshold in tokens, linear timeout, and
    whether prefix keys are passed to the backend) into a :class:`PrefetchConfig`."""
    defaults = PrefetchConfig()  # SGLang's defaults: 256 tokens, 2 s + 0.1 s per Ki token, at most 30 s
    threshold = extra.pop("prefetch_threshold", defaults.threshold_tokens)
    base = extra.pop("prefetch_timeout_base", defaults.timeout_base_s)
    per_ki = extra.pop("prefetch_timeout_per_ki_token", defaults.timeout_per_ki_token_s)
    tmax = extra.pop("prefetch_timeout_max", defaults.timeout_max_s)
    pass_keys = extra.pop("hicache_storage_pass_prefix_keys", False)
    if not isinstance(threshold, int) or isinstance(threshold, bool):
        raise ValueError(f"prefetch_threshold must be an int, got {threshold!r}")
    for name, v in (
        ("prefetch_timeout_base", base),
        ("prefetch_timeout_per_ki_token", per_ki),
        ("prefetch_timeout_max", tmax),
    ):
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ValueError(f"{name} must be a number, got {v!r}")
    if not isinstance(pass_keys, bool):
        raise ValueError(f"hicache_storage_pass_prefix_keys must be a bool, got {pass_keys!r}")
    cfg = PrefetchConfig(
        policy=policy,
        threshold_tokens=threshold,
        timeout_base_s=float(base),
        timeout_per_ki_token_s=float(per_ki),
        timeout_max_s=float(tmax),
    )
    return cfg, pass_keys


def read_l3_format(extra: dict[str, Any]) -> str:
    """Pop ``l3_format`` from the extra config (default ``"hiradix"``)."""
    fmt = extra.pop("l3_format", "hiradix")
    if fmt not in L3_FORMATS:
        raise ValueError(f"l3_format must be one of {L3_FORMATS}, got {fmt!r}")
    return str(fmt)


def read_backup_copy(extra: dict[str, Any], device: torch.device) -> str | None:
    """Pop ``backup_copy`` from the extra config: how backups are copied between CPU pools.
    ``"inline"`` (the default there) copies on the scheduler thread when a step's backups
    start, as SGLang copies; ``"thread"`` hands them to a copy thread. ``None`` for device
    pools on a GPU, whose copies are kernels on a stream; naming the key there is refused."""
    mode = extra.pop("backup_copy", None)
    if device.type != "cpu":
        if mode is not None:
            raise ValueError(f"backup_copy applies to CPU device pools only; these are on {device}")
        return None
    mode = "inline" if mode is None else mode
    if mode not in BACKUP_COPIES:
        raise ValueError(f"backup_copy must be one of {BACKUP_COPIES}, got {mode!r}")
    return str(mode)


def check_supported(params: Any, server_args: Any) -> None:
    """Refuse, naming the option, what this adapter does not do (yet), instead of
    falling back silently."""

    def refuse(option: str, why: str) -> None:
        raise ValueError(f"hiradix.sglang: {option} is not supported: {why}")

    if getattr(params, "cache_ttl_seconds", None):
        refuse("cache TTL", "hiradix evicts by policy only")
    if getattr(params, "enable_session_radix_cache", False):
        refuse("--enable-session-radix-cache", "it needs UnifiedRadixCache")
    if getattr(params, "sliding_window_size", None):
        refuse("sliding-window (SWA) models", "hiradix caches full-attention KV only")
    write = getattr(server_args, "hicache_write_policy", "write_through")
    if write not in WRITE_POLICIES:
        refuse(f"--hicache-write-policy {write!r}", f"use one of {WRITE_POLICIES}")
    policy = str(params.eviction_policy).lower()
    if policy not in policy_names():  # the registry: a policy added with register_policy is taken
        refuse(f"--radix-eviction-policy {policy!r}", f"use one of {tuple(policy_names())}")
    prefetch = getattr(server_args, "hicache_storage_prefetch_policy", "best_effort")
    if prefetch not in PREFETCH_POLICIES:
        refuse(f"--hicache-storage-prefetch-policy {prefetch!r}", f"use one of {PREFETCH_POLICIES}")
    io = getattr(server_args, "hicache_io_backend", "direct")
    if io not in ("direct", "kernel"):
        refuse(f"--hicache-io-backend {io!r}", "hiradix copies with its own engines (direct or kernel)")


def check_supported_since_020(params: Any, server_args: Any) -> None:
    """Refuse, naming the option, what SGLang 0.5.23 (and 0.5.20, whose options these are
    too) can ask for and this cache does not do: each would otherwise be ignored without
    a word."""

    def refuse(option: str, why: str) -> None:
        raise ValueError(f"hiradix.sglang: {option} is not supported: {why}")

    if getattr(params, "eviction_policy_config", None):
        refuse("--radix-eviction-policy-config", "hiradix's eviction policies take no tuning parameters")
    if getattr(params, "tree_core_backend", None) is not None:
        refuse(f"tree core backend {params.tree_core_backend!r}", "hiradix's tree is its own compiled core")
    # mtp_draft_device_pools (MTP / NextN draft layers) follow the target's KV
    # (hiradix.sglang.builder). A sidecar draft (a separate draft model) SGLang registers after
    # building the cache, and only with its own UnifiedRadixCache (kv_cache_builder's
    # maybe_register_hicache_draft raises NotImplementedError for any other cache).
    if getattr(params, "sidecar_draft_device_pools", ()):
        refuse(
            "speculative decoding with a separate (sidecar) draft model's KV pool",
            "sidecar_draft_device_pools is set, and SGLang registers a sidecar draft pool with its own "
            "UnifiedRadixCache only (MTP / NextN drafts, mtp_draft_device_pools, are supported)",
        )
    if getattr(params, "mtp_draft_mamba_pools", ()):
        refuse("MTP draft Mamba state pools", "mtp_draft_mamba_pools is set; hiradix caches no Mamba/SSM state")
    mode = getattr(server_args, "hicache_host_memory_mode", "cache")
    if mode != "cache":
        refuse(f"--hicache-host-memory-mode {mode!r}", "hiradix's host pool is a cache tier ('cache')")
    for option in ("hicache_storage_prefetch_retry_poll_interval", "hicache_storage_prefetch_retry_max_attempts"):
        value = getattr(server_args, option, _RETRY_DEFAULT)
        if value not in (0, _RETRY_DEFAULT):
            refuse(
                f"--{option.replace('_', '-')} {value}",
                "hiradix never re-issues an L3 lookup (SGLang's default and 0 are accepted)",
            )
    if (
        getattr(server_args, "hicache_ratio", None) is None
        and not getattr(server_args, "hicache_size", 0)
        and getattr(server_args, "hicache_host_memory_fraction", None) is not None
    ):
        refuse("--hicache-host-memory-fraction", "hiradix sizes its host pool from --hicache-ratio or --hicache-size")
    if getattr(server_args, "disaggregation_mode", "null") == "decode" and getattr(
        server_args, "disaggregation_decode_enable_radix_cache", False
    ):
        # 0.5.23's decode-side HiCache reads the cache's ``tree_core`` (UnifiedRadixCache's)
        refuse(
            "--disaggregation-decode-enable-radix-cache with --enable-hierarchical-cache",
            "SGLang's decode-side HiCache needs UnifiedRadixCache's tree core",
        )
    if getattr(server_args, "disaggregation_decode_retraction_backup", None) == "host_pool":
        refuse("--disaggregation-decode-retraction-backup host_pool", "it needs UnifiedRadixCache's backups")
    for option in ("enable_lmcache", "enable_flexkv", "enable_unified_cache_external_linker"):
        if getattr(server_args, option, False):
            refuse(f"--{option.replace('_', '-')}", "it selects another tree cache than --radix-cache-backend hiradix")


class ResolvedArgs:
    """A ``ServerArgs`` read as SGLang 0.5.23 reads it: its startup fields with the values
    SGLang's resolution hooks and runtime overrides settled (``resolved_dict()``, e.g. the
    defaulted ``--hicache-ratio``), which the struct's own attributes do not carry."""

    def __init__(self, server_args: Any) -> None:
        self._args = server_args
        resolved = getattr(server_args, "resolved_dict", None)
        self._resolved: dict[str, Any] = resolved() if callable(resolved) else {}

    def __getattr__(self, name: str) -> Any:
        if name in self._resolved:
            return self._resolved[name]
        return getattr(self._args, name)


@dataclass(frozen=True)
class Server:
    """How one generation of SGLang's server hands the cache its options: ``read`` wraps
    its ``ServerArgs`` (the object every option is read from), ``refusals`` check the
    params and the read options in order (each raises ``ValueError`` naming the option),
    and ``prefetch_kwargs`` says whether its L3 prefetches pass keyword arguments (0.5.20
    on: the request's context, and ``storage_hit_end`` for SGLang's re-issues, refused)."""

    read: Callable[[Any], Any]
    refusals: tuple[Callable[[Any, Any], None], ...]
    prefetch_kwargs: bool

    def options(self, params: Any, server_args: Any) -> Any:
        """``server_args`` as this generation reads it, every refusal passed. ``O(options)``."""
        args = self.read(server_args)
        for refuse in self.refusals:
            refuse(params, args)
        return args


def _as_given(server_args: Any) -> Any:
    return server_args


#: SGLang 0.5.15 to 0.5.18: ``ServerArgs`` as given, 0.5.18's options.
SERVER_V18 = Server(read=_as_given, refusals=(check_supported,), prefetch_kwargs=False)
#: SGLang 0.5.20 and 0.5.23: ``ServerArgs`` resolved, their options refused first.
SERVER_SINCE_020 = Server(
    read=ResolvedArgs, refusals=(check_supported_since_020, check_supported), prefetch_kwargs=True
)

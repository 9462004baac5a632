"""L3 page keys: full-width chained SHA-256 hashes, seeded by a namespace.

A page's key is its chained hash (:func:`hiradix.page_hashes`, bit-compatible with
SGLang's ``get_hash_str``) as all 64 lowercase hex digits, never truncated: a shorter
key would let two different prefixes collide and serve each other's KV.

Namespaces
----------
KV bytes are only reusable by a server with the same model weights, KV dtype, page byte
layout and TP sharding, and only by the same tenant when tenants are isolated. A
:class:`KeyNamespace` records all of that; :meth:`KeyNamespace.extra_key` encodes it
canonically (sorted JSON, so equal records give equal strings on every host and Python
version) and :meth:`KeyNamespace.seed` hashes that into the seed of the page-hash chain
(:func:`hiradix.namespace_seed`, the same seed the tree uses for a namespace root's
``extra_key``). Change any field and every key changes, so incompatible KV is never
served. With no namespace the chain is unseeded and the keys are exactly SGLang's
``get_hash_str`` chain.

Pass ``namespace.extra_key()`` as the tree's ``extra_key`` and the tree's
``hash_value`` of a node equals :func:`page_keys` of its tokens here.

Tensor parallelism
------------------
With MHA each TP rank holds its own heads, so the ranks' bytes of one page differ; with
MLA every rank holds the same latent KV. The *chain* never depends on the rank (ranks
must agree on hit counts, so they must compute the same hashes), and the TP size is part
of the namespace (a page sharded 4 ways is not a page sharded 2 ways). The *storage key*
of a sharded page (``tp_sharded=True``, the default; ``KeyNamespace.for_pool`` sets it
from the pool: MHA sharded, MLA not) gets the suffix ``_r{rank}`` when ``tp_size > 1``,
so ranks sharing one backend do not overwrite each other; replicated pages keep the bare
hash and any rank may serve any rank.

SGLang-compatible keys
----------------------
A stock SGLang 0.5.18 node keys a page by the bare ``get_hash_str`` chain of its tokens
(no namespace: not the model, not ``extra_key``, not ``cache_salt``), and its storage
backend appends a suffix naming the model and the rank (:func:`sglang_key_suffix`, as
``HiCacheFile`` names its files). A hiradix node that is to share an L3 with stock SGLang
nodes uses exactly those keys (``hiradix.sglang``'s ``"l3_format": "sglang"``); the
namespaced keys above are the default because SGLang's keep nothing apart that its
tree keeps apart.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import hiradix

if TYPE_CHECKING:
    from hiradix.memory.pools import HostKVPool

__all__ = ["KEY_HEX_CHARS", "KeyNamespace", "page_byte_order", "page_keys", "sglang_key_suffix", "storage_keys"]

KEY_HEX_CHARS = 64
_ENCODING = "hiradix.kv-namespace/1:"


def page_byte_order(layout: str, page_order: str = "hiradix") -> str:
    """The byte order of a host page as :meth:`HostKVPool.get_page_bytes` gives it:
    ``layer_first`` pages are gathered in ``page_first_direct`` order, so the two are
    interchangeable in L3; ``page_first`` is token-major and is not. In SGLang's page
    order (``page_order="sglang"``) the same holds, with names prefixed ``sglang:``.

    >>> page_byte_order("layer_first"), page_byte_order("page_first", "sglang")
    ('page_first_direct', 'sglang:page_first')
    """
    if page_order not in ("hiradix", "sglang"):
        raise ValueError(f"unknown page order {page_order!r}")
    if layout in ("layer_first", "page_first_direct"):
        name = "page_first_direct"
    elif layout == "page_first":
        name = "page_first"
    else:
        raise ValueError(f"unknown host layout {layout!r}")
    return name if page_order == "hiradix" else f"sglang:{name}"


def _check_str(**fields: Any) -> None:
    for name, v in fields.items():
        if not isinstance(v, str):
            raise TypeError(f"{name} must be a str, got {type(v).__name__}")


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything that makes stored KV bytes reusable or not (module docstring).

    >>> a = KeyNamespace(model="llama-3-8b", kv_dtype="bfloat16", tenant="a")
    >>> b = KeyNamespace(model="llama-3-8b", kv_dtype="bfloat16", tenant="b")
    >>> a.seed() != b.seed() and len(a.seed()) == 64
    True
    """

    model: str
    weight_version: str = ""  # checkpoint revision / weight-update version
    kv_dtype: str = ""  # e.g. "bfloat16", "float8_e4m3fn"
    layout: str = ""  # page byte order (see page_byte_order), e.g. "page_first_direct"
    tp_size: int = 1
    tp_sharded: bool = True  # ranks hold different bytes of a page (MHA); False for MLA
    tenant: str = ""  # isolation domain: pages of one tenant are never served to another
    cache_salt: str = ""  # per-request salt (vLLM/SGLang cache_salt), same effect as tenant
    extra: tuple[tuple[str, str], ...] = ()  # anything else: LoRA id, KV shape, ...

    def __post_init__(self) -> None:
        _check_str(
            model=self.model,
            weight_version=self.weight_version,
            kv_dtype=self.kv_dtype,
            layout=self.layout,
            tenant=self.tenant,
            cache_salt=self.cache_salt,
        )
        if not self.model:
            raise ValueError("model must be a non-empty str")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if not isinstance(self.tp_sharded, bool):
            raise TypeError(f"tp_sharded must be a bool, got {type(self.tp_sharded).__name__}")
        try:
            extra = tuple(sorted((str(k), str(v)) for k, v in self.extra))
        except (TypeError, ValueError) as exc:
            raise TypeError("extra must be a sequence of (name, value) pairs") from exc
        if len({k for k, _ in extra}) != len(extra):
            raise ValueError(f"extra has a repeated name: {extra}")
        object.__setattr__(self, "extra", extra)

    @classmethod
    def for_pool(
        cls, model: str, pool: HostKVPool, *, tp_size: int = 1, weight_version: str = "", tenant: str = "", **kw: Any
    ) -> KeyNamespace:
        """The namespace of pages from ``pool``: its dtype, page byte order, sharding
        (MHA sharded, MLA replicated) and KV shape filled in. ``O(1)``."""
        shape = ("kv_shape", repr(pool.shape))
        return cls(
            model=model,
            weight_version=weight_version,
            kv_dtype=str(pool.dtype).removeprefix("torch."),
            layout=page_byte_order(pool.layout, pool.page_order),
            tp_size=tp_size,
            tp_sharded=not pool.is_mla,
            tenant=tenant,
            extra=(shape, *tuple(kw.pop("extra", ()))),
            **kw,
        )

    def extra_key(self) -> str:
        """The canonical string of this namespace: the tree's ``extra_key``. ``O(fields)``.

        >>> KeyNamespace(model="m").extra_key()[:23]
        'hiradix.kv-namespace/1:'
        """
        fields = asdict(self)
        fields["extra"] = [list(p) for p in self.extra]
        return _ENCODING + json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def seed(self) -> str:
        """The 64-hex-digit digest the page-hash chain starts from. ``O(fields)``."""
        return str(hiradix.namespace_seed(self.extra_key()))

    def rank_suffix(self, tp_rank: int) -> str:
        """``"_r{tp_rank}"`` for sharded pages under TP, else ``""``. ``O(1)``."""
        if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be an int in [0, {self.tp_size}), got {tp_rank!r}")
        return f"_r{tp_rank}" if self.tp_sharded and self.tp_size > 1 else ""


def page_keys(
    tokens: Any,
    page_size: int,
    namespace: KeyNamespace | None = None,
    *,
    prior_hash: str | None = None,
    tp_rank: int = 0,
) -> list[str]:
    """Storage keys of every full page of ``tokens``.

    The chain starts at ``prior_hash`` (the hash of the page before ``tokens``, already
    namespaced) if given, else at ``namespace.seed()``, else unseeded (SGLang's chain).
    Runtime complexity: ``O(len(tokens))`` (C SHA-256).

    >>> page_keys([1, 2, 3, 4], 4)
    ['cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72']
    """
    if prior_hash is not None and (len(prior_hash) != KEY_HEX_CHARS or prior_hash != prior_hash.lower()):
        raise ValueError(f"prior_hash must be {KEY_HEX_CHARS} lowercase hex digits, got {prior_hash!r}")
    seed = prior_hash if prior_hash is not None else (namespace.seed() if namespace is not None else None)
    hashes = list(hiradix.page_hashes(tokens, page_size, seed))
    return storage_keys(hashes, namespace, tp_rank)


def sglang_key_suffix(
    model_name: str | None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> str:
    """The suffix SGLang 0.5.18's storage backends append to a page hash (``HiCacheFile``'s
    file names; :mod:`hiradix.sglang.storage` does the same): ``_{model}`` with ``/`` as
    ``-``, then ``_{tp_rank}_{tp_size}`` unless MLA (MLA ranks hold the same bytes),
    ``_{pp_size}_{pp_rank}`` when pipeline stages split the layers and
    ``_cp{cp_rank}_{cp_size}`` when attention context parallelism splits the pages.
    ``O(len(model_name))``.

    >>> sglang_key_suffix("meta-llama/Llama-3.1-8B", tp_rank=1, tp_size=2)
    '_meta-llama-Llama-3.1-8B_1_2'
    >>> sglang_key_suffix(None, is_mla=True, pp_rank=1, pp_size=2)
    '__2_1'
    """
    out = "_" + ("-".join(model_name.split("/")) if model_name else "")
    if not is_mla:
        out += f"_{tp_rank}_{tp_size}"
    if pp_size > 1:
        out += f"_{pp_size}_{pp_rank}"
    if cp_size > 1:
        out += f"_cp{cp_rank}_{cp_size}"
    return out


def storage_keys(hashes: Sequence[str], namespace: KeyNamespace | None = None, tp_rank: int = 0) -> list[str]:
    """The storage keys of chained page ``hashes`` (e.g. a tree node's ``hash_value``):
    the hashes themselves, with the rank suffix where the namespace shards pages.
    ``O(len(hashes))``."""
    for h in hashes:
        if not isinstance(h, str) or len(h) != KEY_HEX_CHARS:
            raise ValueError(f"page hashes must be {KEY_HEX_CHARS}-hex-digit str, got {h!r}")
    suffix = namespace.rank_suffix(tp_rank) if namespace is not None else ""
    if namespace is None and tp_rank != 0:
        raise ValueError("tp_rank without a namespace: give the namespace so the TP shape is in the keys")
    return [h + suffix for h in hashes] if suffix else list(hashes)

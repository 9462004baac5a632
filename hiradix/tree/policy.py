"""Eviction policies, declared as data so that both tree implementations share them.

A policy orders the *evictable leaves* of a tier: the smallest key is evicted first.
The key is built from at most two node fields, each with a sign, and the node's
creation sequence number (``uid``) always breaks ties, so the order is total and the
Cython core and the pure-Python twin pick exactly the same victims.

Because a policy is a declaration and not a Python callback, the Cython core compiles
it into field selectors once and compares keys in C without the GIL. Adding a policy is
one :func:`register_policy` call; the contract suite in ``tests/tree/test_policy.py`` runs
against every registered policy.

Fields a key may use:

``last_access_time``  stamped by ``match_prefix``/``insert``/``insert_host`` (injected clock)
``creation_time``     stamped when the node was created (a split keeps the original's)
``hit_count``         incremented by ``insert`` hits that are not chunked
``priority``          max of the priorities of the requests whose inserts passed through
``slru_protected``    1 if ``hit_count >= protected_threshold`` else 0 (SGLang's SLRU)
``sieve_lap``         the SIEVE hand lap in which the node will next be examined

``second_chance`` turns on SIEVE: a popped victim whose *visited* bit is set (any access
since it was last examined) has the bit cleared, moves to the next lap, and the search goes
on. Each victim set has its own hand, and a node entering a set joins the lap its hand is
in. With the key ``(sieve_lap, creation_time)`` this is SIEVE's hand sweeping from the
oldest to the newest entry and wrapping around, at ``O(log n)`` per examined node. (A node
that becomes a leaf again, after its children left, is examined in the current lap in age
order, where a flat SIEVE queue would have it behind the hand.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

FIELDS: Final = (
    "last_access_time",
    "creation_time",
    "hit_count",
    "priority",
    "slru_protected",
    "sieve_lap",
)


@dataclass(frozen=True)
class EvictionPolicy:
    """A declarative eviction order.

    Parameters
    ----------
    name:
        Registry name, e.g. ``"lru"``.
    key:
        One or two ``(field, sign)`` pairs; ``sign`` is ``+1`` (smallest evicted first)
        or ``-1`` (largest evicted first).
    second_chance:
        SIEVE-style visited bits (see the module docstring).
    protected_threshold:
        Hit count from which a node is in SLRU's protected segment.
    """

    name: str
    key: tuple[tuple[str, int], ...]
    second_chance: bool = False
    protected_threshold: int = 2

    def __post_init__(self) -> None:
        if not 1 <= len(self.key) <= 2:
            raise ValueError(f"policy {self.name!r}: key needs 1 or 2 components, got {len(self.key)}")
        for field, sign in self.key:
            if field not in FIELDS:
                raise ValueError(f"policy {self.name!r}: unknown field {field!r}; choose from {FIELDS}")
            if sign not in (1, -1):
                raise ValueError(f"policy {self.name!r}: sign must be +1 or -1, got {sign!r}")
        if self.protected_threshold < 1:
            raise ValueError("protected_threshold must be >= 1")

    def field_value(self, node: Any, field: str) -> float:
        """Value of one key field on a node object with the twin's attribute names."""
        if field == "slru_protected":
            return 1.0 if node.hit_count >= self.protected_threshold else 0.0
        return float(getattr(node, field))

    def sort_key(self, node: Any) -> tuple[float, float, int]:
        """Full ordering key ``(k0, k1, uid)`` of a node (used by the pure-Python twin)."""
        parts = [sign * self.field_value(node, field) for field, sign in self.key]
        if len(parts) == 1:
            parts.append(0.0)
        return (parts[0], parts[1], node.uid)


_REGISTRY: dict[str, EvictionPolicy] = {}


def register_policy(policy: EvictionPolicy, *, replace: bool = False) -> EvictionPolicy:
    """Add a policy to the registry under ``policy.name``. Runtime complexity: ``O(1)``."""
    if policy.name in _REGISTRY and not replace:
        raise ValueError(f"eviction policy {policy.name!r} is already registered")
    _REGISTRY[policy.name] = policy
    return policy


def get_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """Look a policy up by name (or pass an :class:`EvictionPolicy` through);
    ``ValueError`` for an unknown name, ``TypeError`` for anything but a ``str`` or a policy.

    >>> get_policy("lru").key
    (('last_access_time', 1),)
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"eviction_policy must be a name or an EvictionPolicy, got {type(policy).__name__}")
    try:
        return _REGISTRY[policy]
    except KeyError:
        raise ValueError(f"unknown eviction policy {policy!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def policy_names() -> list[str]:
    """Names of all registered policies, sorted."""
    return sorted(_REGISTRY)


# SGLang's set (sglang/srt/mem_cache/evict_policy.py), plus SIEVE.
for _p in (
    EvictionPolicy("lru", (("last_access_time", 1),)),
    EvictionPolicy("lfu", (("hit_count", 1), ("last_access_time", 1))),
    EvictionPolicy("fifo", (("creation_time", 1),)),
    EvictionPolicy("mru", (("last_access_time", -1),)),
    EvictionPolicy("filo", (("creation_time", -1),)),
    EvictionPolicy("priority", (("priority", 1), ("last_access_time", 1))),
    EvictionPolicy("slru", (("slru_protected", 1), ("last_access_time", 1))),
    EvictionPolicy("sieve", (("sieve_lap", 1), ("creation_time", 1)), second_chance=True),
):
    register_policy(_p)
del _p

WRITE_POLICIES: Final = ("write_through", "write_through_selective", "write_back")


def write_through_threshold(write_policy: str) -> int:
    """Hits after which ``insert`` reports a node for backup (0: never); ``ValueError``
    for an unknown policy, ``TypeError`` for one that is not a ``str``.

    >>> write_through_threshold("write_through_selective")
    2
    """
    if not isinstance(write_policy, str):
        raise TypeError(f"write_policy must be a str, got {type(write_policy).__name__}")
    thresholds = {"write_through": 1, "write_through_selective": 2, "write_back": 0}
    try:
        return thresholds[write_policy]
    except KeyError:
        raise ValueError(f"unknown write policy {write_policy!r}; choose from {', '.join(WRITE_POLICIES)}") from None


def check_tree_args(page_size: object, clock: object, chain_seed: object = None) -> None:
    """Validate the tree constructor arguments shared by both implementations:
    ``ValueError`` for a ``page_size`` that is not an int >= 1, ``OverflowError`` for one
    beyond int64, ``TypeError`` for a clock or a ``chain_seed`` that is not callable."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    if page_size > 2**63 - 1:
        raise OverflowError(f"page_size {page_size} does not fit in int64")
    if clock is not None and not callable(clock):
        raise TypeError("clock must be callable")
    if chain_seed is not None and not callable(chain_seed):
        raise TypeError("chain_seed must be callable")


def seed_digest(seed: object, extra_key: str | None) -> bytes | None:
    """The 32 bytes a root's hash chain starts from, from what the tree's ``chain_seed``
    returned for ``extra_key`` (``None``: the default root): 64 hex digits, or ``None``
    for an unseeded chain (SGLang's). ``TypeError`` / ``ValueError`` name the namespace
    otherwise. ``O(1)``.

    >>> seed_digest("00" * 32, "a") == bytes(32), seed_digest(None, None)
    (True, None)
    """
    if seed is None:
        return None
    where = "the default root" if extra_key is None else f"namespace {extra_key!r}"
    if not isinstance(seed, str):
        raise TypeError(f"chain_seed must return a hex str or None, got {type(seed).__name__} for {where}")
    try:
        digest = bytes.fromhex(seed)
    except ValueError:
        digest = b""
    if len(digest) != 32 or len(seed) != 64:
        raise ValueError(f"chain_seed must return 64 hex digits or None, got {seed!r:.80} for {where}")
    return digest

"""The settings of a simulation run, their defaults, sizes in bytes and the GPU.

:class:`SimConfig` is the one set of defaults: ``hiradix sim``, ``hiradix sweep`` and
:func:`hiradix.sim.run.simulate` all start from it. :meth:`SimConfig.resolve` turns it
into concrete token capacities and checks it: contradictions and options that would be
ignored are errors (:class:`ConfigError`), questionable but possible settings are
warnings that say why (:class:`SimWarning`).

Sizes
-----
A capacity is a :class:`Size`: a token count (``2000000``, ``2M``, ``500k``), a byte
count (``64GiB``, ``80GB``, ``1.5TiB``), ``inf`` (unbounded) or ``auto``. Bytes turn
into tokens with the KV bytes of one token for the model, KV dtype and TP chosen:

* device and host sizes are **per GPU** (per TP rank), as GPU memory and SGLang's
  ``--hicache-size`` are: ``tokens = bytes / rank_bytes_per_token``;
* the L3 size is the whole store (every rank's shards): ``tokens = bytes /
  moved_bytes_per_token``.

The device tier
---------------
``--gpu`` names the GPU (:data:`GPUS`, memory as ``nvidia-smi`` reports it). The KV pool
SGLang would give each rank is::

    kv_bytes = gpu_memory * mem_fraction_static - weights / tp

``mem_fraction_static`` is SGLang 0.5.18's default (``ServerArgs._handle_gpu_memory_settings``)
unless given: ``(gpu_memory - reserved) / gpu_memory`` with ``reserved = 512 MiB + 1.5 MiB
x max(chunked_prefill_size, 2048) + tp / 8 GiB + 2 MiB x cuda_graph_max_bs``, at least
10 GiB on GPUs above 60 GiB, where the chunked-prefill size and CUDA-graph batch size
follow the GPU's memory as in SGLang (the prefill-graph term, a few hundred MiB, is left
out). Weights are the model's total parameters at their checkpoint precision
(:data:`WEIGHTS`). The device size ``auto`` (the default) is ``kv_bytes`` in tokens; an
explicit device size larger than that is a warning, and a model whose weights alone do
not fit is an error for ``auto``.

The host size ``auto`` (the default) is twice the device, SGLang's default
``--hicache-ratio``.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from hiradix.cache.l3 import PREFETCH_POLICIES
from hiradix.sim.timing import DTYPE_BYTES, LINKS, MODELS, TimingModel
from hiradix.tree.policy import WRITE_POLICIES

GIB = 1 << 30
MIB = 1 << 20


class ConfigError(ValueError):
    """A simulation setting that contradicts another, is out of range, or would be ignored."""


class SimWarning(UserWarning):
    """A simulation setting that runs but probably does not model what was meant."""


@dataclass(frozen=True)
class GPU:
    """A GPU's memory (MiB, as ``nvidia-smi`` reports it)."""

    name: str
    memory_mib: int

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPUS = {
    "h100": GPU("h100", 81_559),  # H100 80GB HBM3 (SXM)
    "h200": GPU("h200", 143_771),
    "h20": GPU("h20", 97_871),
    "a100-80g": GPU("a100-80g", 81_920),
    "a100-40g": GPU("a100-40g", 40_960),
    "l40s": GPU("l40s", 46_068),
    "b200": GPU("b200", 183_359),
}
"""GPU presets (``--gpu``)."""

WEIGHTS = {
    "llama-3-8b": (8.03e9, 2.0),  # parameters, bytes per parameter (bf16)
    "llama-3-70b": (70.6e9, 2.0),
    "deepseek-v3": (671e9, 1.0),  # released in fp8
}
"""Total parameters and checkpoint bytes per parameter of each model preset (the
weights every TP rank holds 1/tp of)."""

_OPTION = {"prefetch_wait": "--no-prefetch-wait"}  # CLI spelling where it is not --name-with-dashes
# The settings of the L3 tier, refused without one unless left at their defaults.
_L3_SETTINGS = (
    "l3_tokens",
    "l3_path",
    "l3_master",
    "prefetch_policy",
    "prefetch_threshold",
    "prefetch_wait",
    "l3_link",
)

DEFAULT_HICACHE_RATIO = 2.0
"""SGLang's default ``--hicache-ratio``: host pool = ratio x device pool."""


def sglang_mem_fraction_static(gpu: GPU, tp: int = 1) -> float:
    """SGLang 0.5.18's default ``mem_fraction_static`` for ``gpu`` (module docstring).

    >>> sglang_mem_fraction_static(GPUS["h100"]), sglang_mem_fraction_static(GPUS["a100-40g"])
    (0.835, 0.833)
    """
    mem = gpu.memory_mib
    if mem < 20 * 1024:
        chunk, max_bs = 2048, 8
    elif mem < 35 * 1024:
        chunk, max_bs = 2048, 24 if tp < 4 else 80
    elif mem < 60 * 1024:
        chunk, max_bs = 4096, 32 if tp < 4 else 160
    elif mem < 160 * 1024:
        chunk, max_bs = 8192, 256 if tp < 4 else 512
    else:
        chunk, max_bs = 16384, 512
    reserved = 512 + max(chunk, 2048) * 1.5 + tp / 8 * 1024 + max_bs * 2
    if mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mem - reserved) / mem, 3)


# ------------------------------------------------------------------------------- sizes
_TOKEN_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-z]*)$")


@dataclass(frozen=True)
class Size:
    """A capacity as given: ``tokens``, or ``nbytes``, or neither (``inf``), or ``auto``.

    >>> Size.parse("2M"), Size.parse("64GiB").nbytes, Size.parse("inf").unbounded
    (Size(tokens=2000000), 68719476736, True)
    """

    tokens: int | None = None
    nbytes: int | None = None
    auto: bool = False

    def __repr__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if getattr(self, f.name)]
        return f"Size({', '.join(fields)})"

    @property
    def unbounded(self) -> bool:
        return self.tokens is None and self.nbytes is None and not self.auto

    @classmethod
    def of(cls, value: Size | int | str | None) -> Size:
        """A :class:`Size` from a ``Size``, a token count, ``None`` (unbounded) or text."""
        if isinstance(value, Size):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"a size must be a token count >= 0, a size text or None, got {value!r}")
        return cls(tokens=value)

    @classmethod
    def parse(cls, text: str) -> Size:
        """Parse ``2000000``, ``2M``, ``1.5m``, ``500k``, ``2_000_000`` (tokens, decimal
        suffixes), ``64GiB``, ``80GB``, ``1.5TiB``, ``512MiB`` (bytes), ``inf`` or ``auto``.
        ``ConfigError`` otherwise."""
        spec = text.strip().lower()
        if spec in ("inf", "unbounded"):
            return cls()
        if spec == "auto":
            return cls(auto=True)
        m = _SIZE.match(spec)
        unit = m.group(2) if m else ""
        try:
            number = Decimal(m.group(1).replace("_", "")) if m else Decimal("NaN")
        except InvalidOperation:
            number = Decimal("NaN")
        if m and unit in _BYTE_UNITS and unit not in _TOKEN_SUFFIXES:
            return cls(nbytes=int(number * _BYTE_UNITS[unit]))
        value = number * _TOKEN_SUFFIXES[unit] if unit in _TOKEN_SUFFIXES else Decimal("NaN")
        if not value.is_finite() or value != value.to_integral_value():
            raise ConfigError(
                f"invalid size {text!r}: use tokens (2000000, 2M, 500k), bytes (64GiB, 80GB, 1.5TiB), or inf"
            )
        return cls(tokens=int(value))

    def to_tokens(self, bytes_per_token: float) -> int | None:
        """Tokens (``None``: unbounded); bytes are rounded down to whole tokens."""
        if self.auto:
            raise ConfigError("'auto' is resolved by SimConfig.resolve")
        if self.nbytes is not None:
            return int(self.nbytes // bytes_per_token)
        return self.tokens


def format_gib(nbytes: float) -> str:
    """``1.5 GiB``, ``256 GiB``, ``4 TiB`` (binary units, 3 significant digits).

    >>> format_gib(2_000_000 * 131072), format_gib(64 * GIB), format_gib(3 * MIB)
    ('244 GiB', '64 GiB', '0.00293 GiB')
    """
    if nbytes >= 1 << 40:
        return f"{nbytes / (1 << 40):.3g} TiB"
    return f"{nbytes / GIB:.3g} GiB"


# ------------------------------------------------------------------------------- config
def default_l3_link(l3_backend: str | None) -> str:
    """The L3 link a backend really uses: ``disk`` for the file backend, ``tcp`` for the
    rest (the peer cache's transport unless RDMA is asked for explicitly)."""
    return "disk" if l3_backend == "file" else "tcp"


@dataclass(frozen=True)
class SimConfig:
    """Every setting of one simulation run, with ``hiradix sim``'s defaults.

    Capacities are :class:`Size` values or anything :meth:`Size.of` takes (token counts,
    ``None`` for unbounded, text such as ``"64GiB"``). ``l3_backend=None`` means no L3
    tier; ``l3_tokens`` / ``l3_path`` / ``l3_master`` / prefetch settings / ``l3_link`` are
    then errors unless left at their defaults. ``l3_link=None`` picks :func:`default_l3_link`.
    ``l3_backend`` is ``"memory"``, ``"file"``, ``"peer"`` (an in-process peer-cache
    cluster), ``"mooncake"`` (Mooncake Store; ``l3_master`` names its master, else a private
    one is started), another registered name, or a backend instance.
    """

    page_size: int = 16
    device_tokens: Size | int | str | None = "auto"
    host_tokens: Size | int | str | None = "auto"
    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    l3_backend: Any = "memory"
    l3_tokens: Size | int | str | None = 32_000_000
    l3_path: str | None = None
    l3_master: str | None = None
    verify_bytes: bool = False
    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = 256
    prefetch_wait: bool = True
    load_back_threshold: int = 10
    check_every: int = 0
    model: str = "llama-3-8b"
    kv_dtype: str = "bf16"
    tp: int = 1
    gpu: str = "h100"
    mem_fraction_static: float | None = None
    host_link: str = "pcie5"
    l3_link: str | None = None

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with ``changes`` (``ConfigError`` for an unknown name)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown simulation setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)

    def timing_model(self, **overrides: Any) -> TimingModel:
        """The timing model of this model, KV dtype, TP and links (``overrides`` go to
        :class:`~hiradix.sim.timing.TimingModel`)."""
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}: choose from {', '.join(MODELS)}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown KV dtype {self.kv_dtype!r}: choose from {', '.join(DTYPE_BYTES)}")
        link = self.l3_link or default_l3_link(self.l3_backend if isinstance(self.l3_backend, str) else None)
        for name in (self.host_link, link):
            if name not in LINKS:
                raise ConfigError(f"unknown link {name!r}: choose from {', '.join(LINKS)}")
        kwargs: dict[str, Any] = {
            "model": MODELS[self.model].with_dtype(self.kv_dtype),
            "tp": self.tp,
            "pcie": LINKS[self.host_link],
            "l3": LINKS[link],
        }
        kwargs.update(overrides)
        try:
            return TimingModel(**kwargs)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def resolve(self, timing: TimingModel | None = None) -> ResolvedConfig:
        """Check the settings and turn every capacity into tokens. Raises
        :class:`ConfigError`; returns the warnings in :attr:`ResolvedConfig.warnings`.
        ``timing`` (default :meth:`timing_model`) gives the KV bytes per token.
        Runtime: ``O(1)``."""
        timing = timing or self.timing_model()
        self._check_choices()
        notes: list[str] = []
        room = self._device_room(timing)
        device_tokens = self._device_tokens(room, timing.rank_bytes_per_token, notes)
        host = Size.of(self.host_tokens)
        if host.auto:
            host_tokens = None if device_tokens is None else int(device_tokens * DEFAULT_HICACHE_RATIO)
        else:
            host_tokens = host.to_tokens(timing.rank_bytes_per_token)
        l3_tokens = self._l3_tokens(host_tokens, timing)
        if host_tokens is not None and 0 < host_tokens <= (device_tokens if device_tokens is not None else host_tokens):
            notes.append(
                f"the host tier ({format_tokens(host_tokens)} tokens) is not larger than the device tier "
                f"({format_tokens(device_tokens)}): the tiers are inclusive (a node backed up to the host keeps its "
                f"device copy, and what the device holds is mostly also on the host), so the host adds little "
                f"beyond the device; SGLang's default is a host twice the device"
            )
        return ResolvedConfig(
            config=self,
            timing=timing,
            device_tokens=device_tokens,
            host_tokens=host_tokens,
            l3_tokens=l3_tokens,
            device_fit_tokens=room.fits,
            mem_fraction_static=room.fraction,
            weights_bytes_per_gpu=room.weights,
            warnings=tuple(notes),
        )

    def _check_choices(self) -> None:
        """:meth:`resolve`'s checks of the GPU, page size, memory fraction and policies."""
        if self.gpu not in GPUS:
            raise ConfigError(f"unknown GPU {self.gpu!r}: choose from {', '.join(GPUS)}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ConfigError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")

    def _device_room(self, timing: TimingModel) -> _DeviceRoom:
        """The KV room of one GPU of :attr:`gpu` after the model's weights."""
        gpu = GPUS[self.gpu]
        fraction = self.mem_fraction_static or sglang_mem_fraction_static(gpu, self.tp)
        params, bytes_per_param = WEIGHTS.get(timing.model.name, (timing.model.active_params, 2.0))
        weights = params * bytes_per_param / self.tp
        kv_room = gpu.memory_bytes * fraction - weights
        where = (
            f"{gpu.name} ({gpu.memory_mib / 1024:.0f} GiB x mem_fraction_static {fraction:g} - "
            f"{format_gib(weights)} of {timing.model.name} weights per GPU at tp {self.tp})"
        )
        fits = max(0, int(kv_room // timing.rank_bytes_per_token))
        return _DeviceRoom(fits=fits, kv_room=kv_room, fraction=fraction, weights=weights, where=where)

    def _device_tokens(self, room: _DeviceRoom, rank_bytes: float, notes: list[str]) -> int | None:
        """The device tier in tokens: ``auto`` sizes it to ``room``; a given size that
        does not fit there adds a warning to ``notes``."""
        device = Size.of(self.device_tokens)
        if device.auto:
            if room.fits < self.page_size:
                raise ConfigError(
                    f"the device tier cannot be sized: {room.where} leaves no room for KV; "
                    f"raise --tp, pick a larger --gpu, or give --device-tokens"
                )
            device_tokens: int | None = room.fits // self.page_size * self.page_size
        else:
            device_tokens = device.to_tokens(rank_bytes)
            if device_tokens is not None and device_tokens > room.fits:
                notes.append(
                    f"the device tier ({format_tokens(device_tokens)} tokens, {format_gib(device_tokens * rank_bytes)} "
                    f"of KV per GPU) does not fit on {room.where}: at most {format_tokens(room.fits)} tokens "
                    f"({format_gib(max(room.kv_room, 0))}); --device-tokens auto sizes it from --gpu"
                )
        if device_tokens is not None and device_tokens < self.page_size:
            raise ConfigError(f"the device tier ({device_tokens} tokens) holds no page of {self.page_size} tokens")
        return device_tokens

    def _l3_tokens(self, host_tokens: int | None, timing: TimingModel) -> int | None:
        """The L3 tier in tokens (0 without one), its settings checked against
        :attr:`l3_backend` and the host tier."""
        defaults = SimConfig()
        if self.l3_backend is None:
            ignored = [name for name in _L3_SETTINGS if getattr(self, name) != getattr(defaults, name)]
            if ignored:
                named = ", ".join(f"{n} ({_OPTION.get(n, '--' + n.replace('_', '-'))})" for n in ignored)
                raise ConfigError(f"{named} set without an L3 tier (l3_backend none): ignored, so refused")
            return 0
        if host_tokens == 0:
            raise ConfigError(
                "an L3 tier needs a host tier (L3 pages are read into host memory): give a host size > 0, "
                "or no L3 (--l3-backend none)"
            )
        if self.l3_path is not None and self.l3_backend != "file":
            raise ConfigError("l3_path is for the file backend (--l3-backend file)")
        if self.l3_master is not None and self.l3_backend != "mooncake":
            raise ConfigError("l3_master is for the mooncake backend (--l3-backend mooncake)")
        l3_tokens = Size.of(self.l3_tokens).to_tokens(timing.moved_bytes_per_token)
        if not isinstance(self.l3_backend, str) and self.l3_tokens != defaults.l3_tokens:
            raise ConfigError("l3_tokens is ignored with a backend instance: size the backend itself")
        return l3_tokens


@dataclass(frozen=True)
class _DeviceRoom:
    """The KV room of one GPU after the model's weights (:meth:`SimConfig.resolve`)."""

    fits: int  # tokens of KV that fit, >= 0
    kv_room: float  # bytes (negative when the weights do not fit)
    fraction: float  # the mem_fraction_static used
    weights: float  # bytes of weights per GPU
    where: str  # the GPU, fraction and weights, for messages


@dataclass(frozen=True)
class ResolvedConfig:
    """A checked :class:`SimConfig` with capacities in tokens (``None``: unbounded)."""

    config: SimConfig
    timing: TimingModel
    device_tokens: int | None
    host_tokens: int | None
    l3_tokens: int | None  # 0 without an L3 tier
    device_fit_tokens: int  # what the GPU's KV pool holds (module docstring)
    mem_fraction_static: float
    weights_bytes_per_gpu: float
    warnings: tuple[str, ...] = ()

    def replayer_options(self) -> dict[str, Any]:
        """Keywords of :class:`~hiradix.sim.replay.Replayer`."""
        c = self.config
        return {
            "page_size": c.page_size,
            "device_tokens": self.device_tokens,
            "host_tokens": self.host_tokens,
            "eviction_policy": c.eviction_policy,
            "write_policy": c.write_policy,
            "check_every": c.check_every,
            "l3_backend": c.l3_backend,
            "l3_tokens": self.l3_tokens if c.l3_backend is not None else None,
            "l3_path": c.l3_path,
            "l3_master": c.l3_master,
            "verify_bytes": c.verify_bytes,
            "prefetch_policy": c.prefetch_policy,
            "prefetch_threshold": c.prefetch_threshold,
            "prefetch_wait": c.prefetch_wait,
            "load_back_threshold": c.load_back_threshold,
        }

    def hardware(self) -> dict[str, Any]:
        """The GPU sizing, for reports (JSON-ready)."""
        c = self.config
        return {
            "gpu": c.gpu,
            "gpu_memory_gib": GPUS[c.gpu].memory_mib / 1024,
            "mem_fraction_static": self.mem_fraction_static,
            "weights_gib_per_gpu": self.weights_bytes_per_gpu / GIB,
            "device_fit_tokens": self.device_fit_tokens,
            "rank_kv_bytes_per_token": self.timing.rank_bytes_per_token,
        }

    def emit_warnings(self) -> None:
        """Issue each warning as a :class:`SimWarning`."""
        for note in self.warnings:
            warnings.warn(note, SimWarning, stacklevel=3)


def format_tokens(n: int | None) -> str:
    """Short form of a token count: ``2M``, ``1.5M``, ``500k``, ``inf`` for ``None``.

    >>> format_tokens(1_500_000), format_tokens(500_000), format_tokens(None), format_tokens(12)
    ('1.5M', '500k', 'inf', '12')
    """
    if n is None:
        return "inf"
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)

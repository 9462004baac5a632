"""The simulator's timing model: what the replayed hits are worth in time and bytes.

The replay says, per request, how many prompt tokens were already on the device (L1),
loaded back from host memory (L2), fetched from L3 storage, or recomputed. This module
turns that into time-to-first-token (TTFT), prefill throughput and bytes moved per tier.
It is a first-order model, deliberately small enough to check by hand; every constant is
an option. All of it is documented here, in one place.

KV bytes per token
------------------
From the model shape (:class:`ModelShape`; presets in :data:`MODELS`)::

    MHA / GQA:  bytes/token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes
    MLA:        bytes/token = layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes

=============  ======  ========  ========  ===========  ===========================
preset         layers  kv heads  head dim  bf16 bytes   active params (prefill)
=============  ======  ========  ========  ===========  ===========================
llama-3-8b     32      8         128       131,072      8.03e9 (GQA, MHA-style pool)
llama-3-70b    80      8         128       327,680      70.6e9
deepseek-v3    61      MLA       512 + 64  70,272       37e9 (activated of 671e9)
=============  ======  ========  ========  ===========  ===========================

Tensor parallelism (``tp`` ranks) shards MHA KV by heads, so each rank holds and moves
``1/tp`` of it; MLA's latent is replicated, so each rank moves all of it. Per-rank bytes
set the transfer times (the ranks copy in parallel over their own links); bytes moved
are reported summed over the ranks.

Prefill
-------
Recomputing ``n`` tokens takes ``n / prefill_tokens_per_s`` seconds. Unless given, the
rate comes from the 2-FLOPs-per-parameter rule::

    prefill_tokens_per_s = tp * gpu_tflops * 1e12 * mfu / (2 * active_params)

(default H100 bf16 dense, 989 TFLOPS at 40% MFU: 24,633 tokens/s for llama-3-8b). The
attention term, which grows with the cached prefix, is left out: it makes long
contexts dearer to recompute, so this model understates what hits save there.

A request always computes at least one token (a full hit still recomputes the last token
to get its logits), plus a fixed ``overhead_ms`` (scheduling, sampling, first decode).

Transfers
---------
Each link (:class:`Link`; presets in :data:`LINKS`) costs ``latency + bytes / bandwidth``
per request that uses it, 0 when it moves nothing; bandwidths are in GB/s of 1e9 bytes.

* An L2 hit is loaded back host -> device over PCIe. With ``layerwise`` overlap (SGLang's
  layer-done counter: layer ``i`` computes while layer ``i + 1`` loads), only the part of
  the load that outlasts the compute, plus one layer's share, is exposed:
  ``max(0, load - compute) + load / layers``. Without it the whole load is exposed.
* An L3 hit is fetched storage -> host over the L3 link (``rdma`` or ``tcp`` to a peer's
  host memory, or ``disk``) before the request is scheduled, so it is fully exposed,
  and then loaded back over PCIe like an L2 hit.

So, per request::

    compute = max(input - device_hit - host_hit - l3_hit, 1) / prefill_tokens_per_s
    load    = pcie(host_hit + l3_hit tokens)           exposed as above
    TTFT    = overhead + l3_link(l3_hit tokens) + compute + exposed load

TTFT is the service time on an idle GPU: queueing and batching with other requests
are not modelled. The same formula is evaluated in four *scenarios*: ``all_tiers`` (as
replayed), ``no_l3`` (L3 hits recomputed), ``device_only`` (L2 and L3 hits recomputed)
and ``no_cache`` (everything recomputed). Dropping a lower tier does not change what the
device holds (a loaded-back or recomputed prefix lands on the device either way), so
these counterfactuals are exact for the same device capacity. *Throughput* is prompt
tokens over the summed TTFT of a scenario: what one serial prefill engine sustains.
A lower tier pays only while moving a token's KV is faster than recomputing it: where
one does not, :mod:`hiradix.sim.advice` says so, with the break-even link bandwidth.

Bytes moved per tier are counted from the replay's totals: host -> device (load back),
device -> host (backup), L3 -> host (L3 hits) and host -> L3 (L3 writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
"""KV cache dtypes and their size in bytes."""


@dataclass(frozen=True)
class ModelShape:
    """The KV-relevant shape of a model.

    For MLA set ``mla=True``, ``kv_heads=1`` and ``head_dim = kv_lora_rank +
    qk_rope_head_dim`` (one latent per layer and token, no separate V).
    ``active_params`` (parameters used per token) sets the default prefill rate.

    >>> MODELS["llama-3-8b"].bytes_per_token, MODELS["deepseek-v3"].bytes_per_token
    (131072, 70272)
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    active_params: float
    dtype: str = "bf16"
    mla: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}: choose from {', '.join(DTYPE_BYTES)}")
        for name in ("layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mla and self.kv_heads != 1:
            raise ValueError("an MLA model has one latent 'head' per layer: kv_heads must be 1")
        if not self.active_params > 0:
            raise ValueError(f"active_params must be > 0, got {self.active_params}")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (all ranks together)."""
        per_layer = self.kv_heads * self.head_dim * (1 if self.mla else 2)
        return round(self.layers * per_layer * DTYPE_BYTES[self.dtype])

    def with_dtype(self, dtype: str) -> ModelShape:
        """The same model with another KV dtype."""
        return replace(self, dtype=dtype)


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", layers=32, kv_heads=8, head_dim=128, active_params=8.03e9),
    "llama-3-70b": ModelShape("llama-3-70b", layers=80, kv_heads=8, head_dim=128, active_params=70.6e9),
    "deepseek-v3": ModelShape("deepseek-v3", layers=61, kv_heads=1, head_dim=512 + 64, active_params=37e9, mla=True),
}
"""Model-shape presets (``--model``)."""


@dataclass(frozen=True)
class Link:
    """A data path: ``latency_us`` per transfer plus ``bytes / (bandwidth_gbps * 1e9)``.

    >>> round(Link("x", bandwidth_gbps=10, latency_us=5).seconds(10**9), 9)
    0.100005
    """

    name: str
    bandwidth_gbps: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or self.latency_us < 0:
            raise ValueError(f"link {self.name!r}: bandwidth must be > 0 and latency >= 0")

    def seconds(self, nbytes: Any) -> Any:
        """Transfer time of ``nbytes`` (a number or an array): 0 where it is 0."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        t = np.where(nbytes > 0, self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9), 0.0)
        return float(t) if t.ndim == 0 else t


LINKS = {
    "pcie5": Link("pcie5", bandwidth_gbps=50.0, latency_us=10.0),  # Gen5 x16, pinned host memory
    "pcie4": Link("pcie4", bandwidth_gbps=25.0, latency_us=10.0),  # Gen4 x16
    "rdma": Link("rdma", bandwidth_gbps=45.0, latency_us=5.0),  # one 400 Gb/s NIC, one-sided READ
    "tcp": Link("tcp", bandwidth_gbps=2.5, latency_us=50.0),  # kernel TCP to a peer
    "disk": Link("disk", bandwidth_gbps=6.0, latency_us=100.0),  # one NVMe SSD
}
"""Link presets: ``pcie5``/``pcie4`` for host <-> GPU, ``rdma``/``tcp``/``disk`` for L3."""

SCENARIOS = ("all_tiers", "no_l3", "device_only", "no_cache")
"""The counterfactuals :meth:`TimingModel.estimate` evaluates (see the module docstring)."""


@dataclass(frozen=True)
class TimingModel:
    """Timing constants (see the module docstring); every one is configurable.

    ``prefill_tokens_per_s=None`` derives the rate from ``gpu_tflops``, ``mfu``,
    ``tp`` and the model's ``active_params``.
    """

    model: ModelShape = field(default_factory=lambda: MODELS["llama-3-8b"])
    tp: int = 1
    prefill_tokens_per_s: float | None = None
    gpu_tflops: float = 989.0
    mfu: float = 0.4
    overhead_ms: float = 5.0
    pcie: Link = field(default_factory=lambda: LINKS["pcie5"])
    l3: Link = field(default_factory=lambda: LINKS["rdma"])
    layerwise: bool = True

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if not self.model.mla and self.model.kv_heads % self.tp and self.tp % self.model.kv_heads:
            raise ValueError(f"tp {self.tp} does not divide {self.model.kv_heads} KV heads (or the reverse)")
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if not (self.gpu_tflops > 0 and 0 < self.mfu <= 1 and self.overhead_ms >= 0):
            raise ValueError("gpu_tflops must be > 0, mfu in (0, 1], overhead_ms >= 0")

    @property
    def prefill_rate(self) -> float:
        """Recomputed tokens per second (the whole TP group).

        >>> round(TimingModel().prefill_rate)
        24633
        """
        if self.prefill_tokens_per_s is not None:
            return self.prefill_tokens_per_s
        return self.tp * self.gpu_tflops * 1e12 * self.mfu / (2 * self.model.active_params)

    @property
    def ranks_holding_each_token(self) -> int:
        """How many TP ranks store a copy of each KV byte: 1 for sharded MHA (each rank
        holds its heads; more ranks than heads replicate them), ``tp`` for MLA."""
        if self.model.mla:
            return self.tp
        return max(1, self.tp // self.model.kv_heads)

    @property
    def rank_bytes_per_token(self) -> float:
        """KV bytes of one token that one rank holds and moves."""
        return self.model.bytes_per_token * self.ranks_holding_each_token / self.tp

    @property
    def moved_bytes_per_token(self) -> float:
        """KV bytes moved per token summed over the ranks."""
        return self.rank_bytes_per_token * self.tp

    def ttft(self, input_tokens: Any, device_hit: Any, host_hit: Any, l3_hit: Any) -> np.ndarray:
        """TTFT in seconds per request (arrays of tokens, broadcast together).
        ``O(requests)``."""
        total = np.asarray(input_tokens, dtype=np.float64)
        device, host, l3 = (np.asarray(x, dtype=np.float64) for x in (device_hit, host_hit, l3_hit))
        compute = np.maximum(total - device - host - l3, 1.0) / self.prefill_rate
        load = np.asarray(self.pcie.seconds((host + l3) * self.rank_bytes_per_token))
        if self.layerwise:
            load = np.where(load > 0, np.maximum(load - compute, 0.0) + load / self.model.layers, 0.0)
        fetch = np.asarray(self.l3.seconds(l3 * self.rank_bytes_per_token))
        return np.asarray(self.overhead_ms * 1e-3 + fetch + compute + load)

    def estimate(self, input_tokens: Any, device_hit: Any, host_hit: Any, l3_hit: Any) -> TimingEstimate:
        """TTFT per request in each of :data:`SCENARIOS`. ``O(requests)``."""
        zero = np.zeros_like(np.asarray(device_hit, dtype=np.float64))
        splits = {
            "all_tiers": (device_hit, host_hit, l3_hit),
            "no_l3": (device_hit, host_hit, zero),
            "device_only": (device_hit, zero, zero),
            "no_cache": (zero, zero, zero),
        }
        ttft = {name: self.ttft(input_tokens, *split) for name, split in splits.items()}
        return TimingEstimate(self, int(np.sum(input_tokens)), ttft)

    def bytes_moved(self, stats: Any) -> dict[str, float]:
        """Bytes moved per tier over a replay, summed over ranks, from a
        :class:`~hiradix.sim.replay.ReplayStats`."""
        per_token = self.moved_bytes_per_token
        return {
            "host_to_device": stats.load_back_tokens * per_token,
            "device_to_host": stats.backup_tokens * per_token,
            "l3_to_host": stats.l3_hit_tokens * per_token,
            "host_to_l3": stats.l3_write_tokens * per_token,
        }

    def describe(self) -> dict[str, Any]:
        """Constants and derived rates, for reports (JSON-ready)."""
        return {
            "model": self.model.name,
            "kv_dtype": self.model.dtype,
            "mla": self.model.mla,
            "layers": self.model.layers,
            "kv_bytes_per_token": self.model.bytes_per_token,
            "tp": self.tp,
            "prefill_tokens_per_s": self.prefill_rate,
            "overhead_ms": self.overhead_ms,
            "pcie": {"name": self.pcie.name, "gbps": self.pcie.bandwidth_gbps, "latency_us": self.pcie.latency_us},
            "l3": {"name": self.l3.name, "gbps": self.l3.bandwidth_gbps, "latency_us": self.l3.latency_us},
            "layerwise_overlap": self.layerwise,
        }


@dataclass(frozen=True)
class TimingEstimate:
    """TTFT per request (seconds) in each scenario, and summaries of it."""

    timing: TimingModel
    input_tokens: int
    ttft: dict[str, np.ndarray]

    def percentiles(self, scenario: str = "all_tiers", qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
        """``{"p50": seconds, ...}`` of one scenario (all 0.0 with no requests)."""
        values = self.ttft[scenario]
        if not len(values):
            return {f"p{q:g}": 0.0 for q in qs}
        return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(values, qs), strict=True)}

    def throughput(self, scenario: str = "all_tiers") -> float:
        """Prompt tokens per second of busy prefill time in ``scenario`` (0.0 if idle)."""
        busy = float(np.sum(self.ttft[scenario]))
        return self.input_tokens / busy if busy else 0.0

    def summary(self) -> dict[str, dict[str, float]]:
        """Per scenario: mean and percentile TTFT (seconds) and throughput."""
        out = {}
        for name, values in self.ttft.items():
            out[name] = {
                "mean_s": float(np.mean(values)) if len(values) else 0.0,
                **{f"{k}_s": v for k, v in self.percentiles(name).items()},
                "throughput_tokens_per_s": self.throughput(name),
            }
        return out

"""One simulation run: a workload through the replayer, recorded per request, timed.

:func:`simulate` is the single place that builds the replayer and feeds it a workload;
the CLI, the sweeps and the example all go through it. Swapping the replayer's internals
(it goes through ``HiRadixCache``, with an optional L3 tier) changed nothing here: it
keeps :class:`~hiradix.sim.replay.Replayer`'s ``replay(requests, observer)``,
``config()`` and ``occupancy()``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import hiradix
from hiradix.cache import TreeFactory
from hiradix.sim.config import SimConfig
from hiradix.sim.extras import progress_bar
from hiradix.sim.generators import MooncakeWorkload, Workload
from hiradix.sim.replay import Replayer, ReplayStats, RequestRecord
from hiradix.sim.timing import TimingEstimate, TimingModel

TIMELINE_FIELDS = (
    "timestamp_ms",
    "input_tokens",
    "prompt_tokens",
    "device_hit",
    "host_hit",
    "l3_hit",
    "ideal_hit",
    "fitted",
    "device_used",
    "host_used",
    "l3_used",
)


class Timeline:
    """Per-request columns of a replay; pass it as the replay's observer.

    ``Timeline()(record)`` appends one :class:`~hiradix.sim.replay.RequestRecord`;
    :meth:`arrays` returns the columns :data:`TIMELINE_FIELDS` as numpy arrays.
    Memory is ``O(requests)`` (11 numbers per request).
    """

    def __init__(self) -> None:
        self._rows: list[tuple[float, ...]] = []

    def __call__(self, record: RequestRecord) -> None:
        s = record.served
        self._rows.append(
            (
                record.request.timestamp,
                record.request.input_length,
                record.prompt,
                s.device_hit,
                s.host_hit,
                s.l3_hit,
                record.ideal,
                s.fitted,
                record.device_used,
                record.host_used,
                record.l3_used,
            )
        )

    def __len__(self) -> int:
        return len(self._rows)

    def arrays(self) -> dict[str, np.ndarray]:
        table = np.asarray(self._rows, dtype=np.float64).reshape(len(self._rows), len(TIMELINE_FIELDS))
        out: dict[str, np.ndarray] = {name: table[:, i].astype(np.int64) for i, name in enumerate(TIMELINE_FIELDS)}
        out["timestamp_ms"] = table[:, 0]
        return out


@dataclass(frozen=True)
class SimResult:
    """Everything a run produced, for :mod:`hiradix.sim.report`."""

    workload: dict[str, Any]
    config: dict[str, Any]
    stats: ReplayStats
    timeline: dict[str, np.ndarray]
    timing: TimingEstimate
    wall_s: float
    implementation: str = field(default_factory=lambda: hiradix.IMPLEMENTATION)
    bad_lines: int = 0
    hardware: dict[str, Any] = field(default_factory=dict)  # ResolvedConfig.hardware()
    warnings: tuple[str, ...] = ()  # the configuration's warnings (SimConfig.resolve)


def simulate(
    workload: Workload,
    config: SimConfig | None = None,
    *,
    timing: TimingModel | None = None,
    progress: bool | None = False,
    tree_cls: TreeFactory | None = None,
    **settings: Any,
) -> SimResult:
    """Replay ``workload`` and time it.

    ``config`` (default :class:`~hiradix.sim.config.SimConfig`, the CLI's defaults) with
    ``settings`` (any of its fields: ``device_tokens``, ``host_tokens``, ``l3_backend``,
    ``gpu`` ...) applied on top. The configuration is checked first
    (:class:`~hiradix.sim.config.ConfigError`, a ``ValueError``); its warnings are
    issued as :class:`~hiradix.sim.config.SimWarning` and kept in the result. ``timing``
    defaults to the configuration's timing model. The replayer's cache is closed (its
    threads stopped) before this returns. ``progress``: ``True`` shows a progress bar on
    stderr, ``None`` shows it only when stderr is a terminal, ``False`` never. Errors of
    the workload (:class:`~hiradix.sim.trace.TraceError`, ``OSError``) propagate; a
    workload with no requests is a ``ValueError``.
    Runtime complexity: the replay's, plus ``O(requests)``.
    """
    config = (config or SimConfig()).replace(**settings)
    resolved = config.resolve(timing)
    resolved.emit_warnings()
    timing = resolved.timing
    replayer = Replayer(tree_cls, **resolved.replayer_options())
    timeline = Timeline()
    source: Any = workload
    if isinstance(workload, MooncakeWorkload):
        source = workload.trace()  # keep the reader to read its bad-line count
    start = time.perf_counter()
    total = workload.count() if progress is not False else None
    with (
        progress_bar(
            source,
            total=total,
            unit="req",
            file=sys.stderr,
            disable=True if progress is False else (None if progress is None else False),
            dynamic_ncols=True,
        ) as requests,
        replayer,
    ):
        stats = replayer.replay(requests, timeline)
    wall = time.perf_counter() - start
    if stats.requests == 0:
        described = workload.describe()
        name = described.get("path") or described.get("workload", "workload")
        raise ValueError(f"empty workload: {name} has no requests to replay")
    columns = timeline.arrays()
    estimate = timing.estimate(columns["input_tokens"], columns["device_hit"], columns["host_hit"], columns["l3_hit"])
    return SimResult(
        workload=workload.describe(),
        config={**replayer.config(), "gpu": config.gpu, "model": timing.model.name, "tp": timing.tp},
        stats=stats,
        timeline=columns,
        timing=estimate,
        wall_s=wall,
        bad_lines=getattr(source, "bad_lines", 0),
        hardware=resolved.hardware(),
        warnings=resolved.warnings,
    )

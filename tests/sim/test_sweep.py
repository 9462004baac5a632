"""Sweeps: the grid, the rows (order, shape, monotone in capacity under LRU), the same
results from spawned workers as in-process, the table and plot, and the CLI. Workloads
are a few hundred generated requests; one test starts two spawned workers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hiradix.cli import main
from hiradix.sim.generators import ChatWorkload
from hiradix.sim.report import png_bytes
from hiradix.sim.sweep import SweepCell, SweepRow, grid, plot_sweep, run_sweep, sweep_table

WORKLOAD = ChatWorkload(requests=200, seed=11)


def test_grid_is_the_product_in_nested_order() -> None:
    cells = grid([1, 2], [None, 5], ["lru", "sieve"], ["write_through", "write_back"])
    assert len(cells) == 16
    assert cells[0] == SweepCell(1, None, "lru", "write_through")
    assert cells[1] == SweepCell(1, None, "lru", "write_back")
    assert cells[-1] == SweepCell(2, 5, "sieve", "write_back")


def test_rows_follow_the_cells_and_hit_more_with_more_device() -> None:
    cells = grid([10_000, 20_000, 40_000, None], [0], ["lru"], ["write_through"])
    rows = run_sweep(WORKLOAD, cells, jobs=1, l3_backend=None)
    assert [r.cell for r in rows] == cells
    assert all(r.requests == 200 and r.too_large_requests == 0 for r in rows)
    hits = [r.hit_rate for r in rows]
    assert hits == sorted(hits) and hits[0] < hits[-1] == pytest.approx(rows[-1].ideal_hit_rate)
    assert rows[-1].device_evicted_tokens == 0 and rows[0].device_evicted_tokens > 0
    record = rows[0].to_dict()
    assert list(record)[:4] == ["device_tokens", "host_tokens", "eviction_policy", "write_policy"]
    assert set(record) == {f.name for f in dataclasses.fields(SweepCell)} | {
        f.name for f in dataclasses.fields(SweepRow) if f.name != "cell"
    }


def test_spawned_workers_give_the_in_process_results() -> None:
    cells = grid([15_000], [60_000], ["lru", "sieve"], ["write_through"])

    def strip(rows: list[SweepRow]) -> list[dict[str, object]]:
        return [{k: v for k, v in r.to_dict().items() if k != "wall_s"} for r in rows]

    assert strip(run_sweep(WORKLOAD, cells, jobs=2, l3_backend=None)) == strip(
        run_sweep(WORKLOAD, cells, jobs=1, l3_backend=None)
    )


def test_table_and_plot() -> None:
    rows = run_sweep(
        WORKLOAD, grid([10_000, None], [50_000], ["lru", "lfu"], ["write_through"]), jobs=1, l3_backend=None
    )
    table = sweep_table(rows).splitlines()
    assert len(table) == 1 + len(rows) and "TTFT p50" in table[0]
    assert table[-1].split()[:4] == ["inf", "50k", "lfu", "write_through"]
    assert png_bytes(plot_sweep(rows)).startswith(b"\x89PNG")


def test_jobs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_sweep(WORKLOAD, [], jobs=0)


@pytest.mark.parametrize("spelling", [["sweep"], ["sim", "sweep"]], ids=["sweep", "sim-sweep"])
def test_cli_sweep_writes_one_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spelling: list[str]
) -> None:
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = [*spelling, "--workload", "chat", "--limit", "150", "--device-tokens", "10k,inf", "--host-tokens", "0"]
    argv += ["--l3-backend", "none"]
    argv += ["--eviction-policies", "lru,sieve", "--write-policies", "write_through,write_back", "--jobs", "1"]
    assert main([*argv, "--json", str(out), "--plot", str(plot), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 2 * 1 * 2 * 2
    assert {(r["device_tokens"], r["eviction_policy"], r["write_policy"]) for r in data["rows"]} == {
        (d, e, w) for d in (10_000, None) for e in ("lru", "sieve") for w in ("write_through", "write_back")
    }
    assert plot.read_bytes().startswith(b"\x89PNG")
    text = capsys.readouterr().out
    assert "chat (seed 0), 150 requests, 8 runs" in text and len(text.splitlines()) == 2 + 8 + 1


def test_cli_sweep_rejects_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--workload", "chat", "--eviction-policies", "lru,nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice 'nope'" in err

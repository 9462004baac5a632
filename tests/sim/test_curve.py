"""One-pass capacity curves (hiradix.sim.curve) against brute force and full replays.

* the stack-position routine against a brute-force LRU recency list (hypothesis);
* the curve of a workload against a brute-force page-level LRU cache that serves each
  request its longest cached prefix, at every capacity;
* the curve against replays through the real HiRadixCache (``simulate``): a small
  synthetic workload always, the full Mooncake conversation trace when it is present
  (within 0.5 points for LRU at page 16);
* the recommendation and the ``hiradix plan`` command.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hiradix.cli import main
from hiradix.sim.curve import DEFAULT_PRICES, GIB, CapacityCurve, recommend, stack_positions
from hiradix.sim.generators import ChatWorkload, MooncakeWorkload
from hiradix.sim.run import simulate
from hiradix.sim.trace import BLOCK_TOKENS, MooncakeTrace, TraceRequest
from tests.sim.test_sim import TRACE, needs_trace


# ----------------------------------------------------------------------------- brute force
def brute_positions(requests: list[list[int]]) -> list[int]:
    """Positions by a recency list: at each request's arrival, 1 + index of the page in
    the most-recent-first list (0: absent); then the request's pages are touched in order."""
    recency: list[int] = []
    out: list[int] = []
    for keys in requests:
        snapshot = {k: i + 1 for i, k in enumerate(recency)}
        out.extend(snapshot.get(k, 0) for k in keys)
        for k in keys:
            if k in recency:
                recency.remove(k)
            recency.insert(0, k)
    return out


def brute_prefix_hits(chains: list[list[int]], capacity: int) -> int:
    """Pages hit by a page-level LRU cache of ``capacity`` pages that serves each request
    the longest cached prefix of its chain (root first), then caches the whole chain,
    evicting the least recently used page; pages of a request are touched deepest first."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits = 0
    for chain in chains:
        k = 0
        while k < len(chain) and chain[k] in cache:
            k += 1
        hits += k
        for page in reversed(chain):
            cache[page] = None
            cache.move_to_end(page)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


# ----------------------------------------------------------------------------- stack positions
requests_strategy = st.lists(st.lists(st.integers(0, 12), max_size=8, unique=True), max_size=30)


@settings(max_examples=300, deadline=None)
@given(requests_strategy)
def test_stack_positions_match_a_recency_list(requests: list[list[int]]) -> None:
    keys = np.array([k for r in requests for k in r], dtype=np.int64)
    lengths = np.array([len(r) for r in requests], dtype=np.int64)
    assert stack_positions(keys, lengths).tolist() == brute_positions(requests)


@settings(max_examples=200, deadline=None)
@given(requests_strategy)
def test_positions_give_the_hits_of_an_lru_cache_at_every_capacity(requests: list[list[int]]) -> None:
    keys = np.array([k for r in requests for k in r], dtype=np.int64)
    positions = stack_positions(keys, np.array([len(r) for r in requests], dtype=np.int64))
    for capacity in range(1, 15):
        cache: OrderedDict[int, None] = OrderedDict()
        hits = 0
        for r in requests:
            hits += sum(k in cache for k in r)
            for k in r:
                cache[k] = None
                cache.move_to_end(k)
            while len(cache) > capacity:
                cache.popitem(last=False)
        assert hits == int(np.count_nonzero((positions > 0) & (positions <= capacity))), capacity


def test_a_page_repeated_in_a_request_keeps_its_arrival_position() -> None:
    keys = np.array([5, 6, 7, 6, 5, 6], dtype=np.int64)
    assert stack_positions(keys, np.array([3, 3])).tolist() == [0, 0, 0, 2, 3, 2]


def test_stack_positions_reject_bad_lengths() -> None:
    with pytest.raises(ValueError, match="sum to"):
        stack_positions(np.array([1, 2]), np.array([3]))
    with pytest.raises(ValueError, match=">= 0"):
        stack_positions(np.array([1, 2]), np.array([3, -1]))
    assert stack_positions(np.array([], dtype=np.int64), np.array([0])).tolist() == []


# ----------------------------------------------------------------------------- curve semantics
def random_trace(seed: int, requests: int = 120) -> list[TraceRequest]:
    """Requests that continue earlier ones (multi-turn) or start fresh, with lengths not
    aligned to blocks or pages, and block ids reused under different parents (which the
    tree must not share)."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    convs: list[list[int]] = []
    next_id = 0
    for line in range(1, requests + 1):
        if convs and rng.random() < 0.7:
            base = list(rng.choice(convs))
            base = base[: rng.randint(0, len(base))]
        else:
            base = [rng.randint(0, 5)] if rng.random() < 0.3 else []  # ids shared across chains
        for _ in range(rng.randint(1, 4)):
            base.append(next_id)
            next_id += 1
        convs.append(base)
        length = (len(base) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        out.append(TraceRequest(line, float(line), length, 1, tuple(base)))
    return out


def chains_of(requests: list[TraceRequest], page_size: int) -> list[list[tuple[int, ...]]]:
    """Each prompt's pages, root first, named by their token prefix (the tree's identity)."""
    out = []
    for r in requests:
        tokens = r.tokens()
        n = len(tokens) // page_size
        out.append([tuple(tokens[: (j + 1) * page_size].tolist()) for j in range(n)])
    return out


@pytest.mark.parametrize("page_size", [16, 64, 100, 512])
@pytest.mark.parametrize("seed", [0, 1])
def test_curve_equals_a_page_level_prefix_cache_at_every_capacity(page_size: int, seed: int) -> None:
    requests = random_trace(seed)
    curve = CapacityCurve.from_requests(requests, page_size=page_size)
    chains = chains_of(requests, page_size)
    ids: dict[tuple[int, ...], int] = {}
    int_chains = [[ids.setdefault(p, len(ids)) for p in chain] for chain in chains]
    assert curve.prompt_tokens == sum(len(c) for c in chains) * page_size
    for pages in sorted({1, 2, 7, 30, 100, 300, curve.max_pages, curve.max_pages + 5}):
        want = brute_prefix_hits(int_chains, pages) * page_size
        assert int(curve.token_hits[min(pages, curve.max_pages)]) == want, pages
    # Unbounded capacity: every page seen before hits.
    assert curve.token_hits[-1] == brute_prefix_hits(int_chains, 10**9) * page_size


def test_block_ids_reused_under_another_parent_are_not_shared() -> None:
    a = TraceRequest(1, 0, 1024, 1, (0, 1))
    b = TraceRequest(2, 1, 1024, 1, (2, 1))  # block 1 after another block: other tokens
    curve = CapacityCurve.from_requests([a, b], page_size=512)
    assert curve.ideal_token_hit_rate == 0.0
    c = CapacityCurve.from_requests([a, a, b], page_size=512)
    assert c.token_hits[-1] == 1024 and c.token_hit_rate(512) == 512 / 3072


def test_block_hit_rate_counts_blocks_as_the_replay_does() -> None:
    # 1300 tokens at page 16: prompt 1296, 3 blocks; the whole prompt hits the 2nd time,
    # so its cut 3rd block counts too. A 1540-token prompt (4 blocks, the last holds no
    # whole page) can hit at most 3.
    r = TraceRequest(1, 0, 1300, 1, (0, 1, 2))
    s = TraceRequest(2, 0, 1540, 1, (7, 8, 9, 10))
    curve = CapacityCurve.from_requests([r, r, s, s], page_size=16)
    assert curve.blocks == 14
    assert curve.block_hits[-1] == 3 + 3
    assert curve.block_hit_rate(float("inf")) == 6 / 14
    # With room for 32 pages (512 tokens), the repeats each hit their first block only.
    assert curve.block_hit_rate(512) == 2 / 14
    assert curve.block_hit_rate(511) == 0


def test_curve_is_monotone_and_ends_at_the_ideal() -> None:
    curve = CapacityCurve.from_requests(random_trace(3), page_size=16)
    assert (np.diff(curve.token_hits) >= 0).all() and (np.diff(curve.block_hits) >= 0).all()
    assert curve.token_hit_rate(curve.max_useful_tokens) == curve.ideal_token_hit_rate
    assert curve.token_hit_rate(curve.max_useful_tokens - curve.page_size) < curve.ideal_token_hit_rate
    rates = curve.token_hit_rate([0, 1000, float("inf")])
    assert rates[0] == 0 and rates[2] == curve.ideal_token_hit_rate
    knee = curve.knee()
    assert 0 < knee < curve.max_useful_tokens and knee % 16 == 0
    sizes = curve.sizes(1000)
    assert sizes[0] == 1000 and sizes[-1] >= curve.max_useful_tokens > sizes[-2]


def test_capacity_for_is_the_smallest_capacity_reaching_the_rate() -> None:
    curve = CapacityCurve.from_requests(random_trace(4), page_size=16)
    for rate in (0.01, 0.1, curve.ideal_token_hit_rate / 2, curve.ideal_token_hit_rate):
        c = curve.capacity_for(rate)
        assert c is not None and curve.token_hit_rate(c) >= rate - 1e-12
        assert c == 0 or curve.token_hit_rate(c - 16) < rate
    assert curve.capacity_for(curve.ideal_token_hit_rate + 0.01) is None


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="no requests"):
        CapacityCurve.from_requests([], page_size=16)
    with pytest.raises(ValueError, match="whole page"):
        CapacityCurve.from_requests([TraceRequest(1, 0, 10, 1, (0,))], page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        CapacityCurve.from_requests(random_trace(0), page_size=0)
    curve = CapacityCurve.from_requests(random_trace(0), page_size=16)
    with pytest.raises(ValueError, match=">= 0"):
        curve.token_hit_rate(-1)
    with pytest.raises(ValueError, match=">= 0"):
        curve.token_hit_rate(float("nan"))


# ----------------------------------------------------------------------------- against replays
def assert_agrees(curve: CapacityCurve, workload: object, device: int, host: int, tol: float) -> dict[str, float]:
    """Replay through HiRadixCache (LRU, write_through, no L3) and compare per tier."""
    result = simulate(workload, page_size=curve.page_size, device_tokens=device, host_tokens=host, l3_backend=None)
    rates = result.stats.rates()
    tiers = curve.tiers(device, host)
    assert result.stats.prompt_tokens == curve.prompt_tokens and result.stats.blocks == curve.blocks
    assert rates["ideal_token_hit_rate"] == pytest.approx(curve.ideal_token_hit_rate, abs=1e-12)
    got = {
        "device": rates["device_token_hit_rate"] - tiers["device"],
        "total": rates["token_hit_rate"] - tiers["total"],
        "device_block": rates["device_block_hit_rate"] - curve.block_hit_rate(device),
        "total_block": rates["block_hit_rate"] - curve.block_hit_rate(host),
    }
    for name, diff in got.items():
        assert abs(diff) <= tol, (device, host, name, diff)
        # Node-granular eviction can only make the cache hold less than the model.
        assert diff <= 1e-12, (device, host, name, diff)
    return got


@pytest.mark.parametrize(("device", "host"), [(60_000, 200_000), (150_000, 600_000)])
def test_curve_agrees_with_replays_of_a_synthetic_workload(device: int, host: int) -> None:
    workload = ChatWorkload(requests=400, seed=1)
    curve = CapacityCurve.from_requests(workload, page_size=16)
    assert curve.max_prompt_tokens <= device  # every request fits: the model's assumption
    assert_agrees(curve, workload, device, host, tol=0.01)


@pytest.fixture(scope="module")
def trace_curve() -> CapacityCurve:
    return CapacityCurve.from_requests(MooncakeTrace(TRACE), page_size=16)


@needs_trace
@pytest.mark.parametrize(("device", "host"), [(1_000_000, 4_000_000), (4_000_000, 16_000_000)])
@pytest.mark.slow  # a replay of the whole trace (or a long randomized run)
def test_curve_agrees_with_full_replays_of_the_conversation_trace(
    trace_curve: CapacityCurve, device: int, host: int
) -> None:
    """LRU at page 16: within 0.5 points of the replay, per tier, tokens and blocks."""
    assert_agrees(trace_curve, MooncakeWorkload(TRACE), device, host, tol=0.005)


@needs_trace
def test_conversation_trace_ideal(trace_curve: CapacityCurve) -> None:
    # The trace README's block ideal, and the replay's token ideal (bench/RESULTS_sim.md).
    assert trace_curve.ideal_block_hit_rate == pytest.approx(0.3664, abs=5e-5)
    assert trace_curve.ideal_token_hit_rate == pytest.approx(0.3738, abs=5e-5)
    assert trace_curve.requests == 12_031


# ----------------------------------------------------------------------------- recommendation
def test_recommend_picks_the_cheapest_layout_reaching_the_target() -> None:
    curve = CapacityCurve.from_requests(random_trace(5, 300), page_size=16)
    target = curve.ideal_token_hit_rate * 0.9
    bpt = 131_072
    plans = recommend(curve, target, bytes_per_token=bpt)
    assert [p.layout for p in plans] == ["device+host+l3", "device+host", "device"]  # default prices fall by tier
    assert [p.cost for p in plans] == sorted(p.cost for p in plans)
    need = curve.capacity_for(target)
    for p in plans:
        assert p.hit_rate >= target - 1e-12
        assert p.device_tokens >= curve.max_prompt_tokens
        assert p.device_hit_rate + p.host_hit_rate + p.l3_hit_rate == pytest.approx(p.hit_rate)
        assert max(p.device_tokens, p.host_tokens, p.l3_tokens) == need
        want = sum(getattr(p, f"{t}_tokens") * bpt / GIB * DEFAULT_PRICES[t] for t in ("device", "host", "l3"))
        assert p.cost == pytest.approx(want)
    # Expensive storage: the device alone is cheapest.
    flat = recommend(curve, target, bytes_per_token=bpt, prices={"host": 1000, "l3": 1000})
    assert flat[0].layout == "device" and flat[0].device_tokens == need


def test_recommend_drops_lower_tiers_when_the_floor_reaches_the_target() -> None:
    curve = CapacityCurve.from_requests(random_trace(5, 300), page_size=16)
    plans = recommend(curve, 0.001, bytes_per_token=2, min_device_tokens=curve.max_useful_tokens)
    assert [p.layout for p in plans] == ["device"]


def test_recommend_bad_input() -> None:
    curve = CapacityCurve.from_requests(random_trace(5), page_size=16)
    with pytest.raises(ValueError, match="above the ideal"):
        recommend(curve, min(1.0, curve.ideal_token_hit_rate + 0.01), bytes_per_token=2)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        recommend(curve, 0, bytes_per_token=2)
    with pytest.raises(ValueError, match="unknown tier"):
        recommend(curve, 0.1, bytes_per_token=2, prices={"ssd": 1})
    with pytest.raises(ValueError, match="finite number"):
        recommend(curve, 0.1, bytes_per_token=2, prices={"host": -1})


# ----------------------------------------------------------------------------- hiradix plan
def write_trace(path: Path, requests: list[TraceRequest]) -> Path:
    with path.open("w") as f:
        for r in requests:
            record = {"timestamp": r.timestamp, "input_length": r.input_length, "output_length": 1}
            f.write(json.dumps({**record, "hash_ids": list(r.hash_ids)}) + "\n")
    return path


def run_cli(argv: list[str]) -> int | str | None:
    """The exit status of ``hiradix ARGV``, whether argparse or the command ends it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_cli_plan_prints_the_curve_and_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", random_trace(6, 300))
    curve = CapacityCurve.from_requests(MooncakeTrace(trace), page_size=16)
    target = round(curve.ideal_token_hit_rate * 0.8, 3)
    argv = ["plan", "--trace", str(trace), "--target-hit-rate", str(target), "--no-progress"]
    argv += ["--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"), "--prices", "host=4,l3=0.2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "knee" in out and "device+host+l3" in out and "recommended" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["curve"]["ideal_token_hit_rate"] == curve.ideal_token_hit_rate
    assert data["prices"] == {**DEFAULT_PRICES, "host": 4.0, "l3": 0.2}
    assert data["plans"][0]["hit_rate"] >= target
    assert data["bytes_per_token"] == 131_072
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--page-size", "0"], "page size"),
        (["--target-hit-rate", "1.5"], "hit rate"),
        (["--target-hit-rate", "0.99"], "above the ideal"),
        (["--prices", "gpu=3"], "unknown tier"),
        (["--prices", "host"], "TIER=PRICE"),
        (["--min-device-tokens", "-5"], "invalid size"),
        (["--json", "/no/such/dir/x.json"], "folder does not exist"),
    ],
)
def test_cli_plan_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", random_trace(7, 50))
    assert run_cli(["plan", "--trace", str(trace), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_plan_empty_or_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plan", "--trace", str(empty), "--no-progress"]) == 2
    assert "no requests" in capsys.readouterr().err
    assert main(["plan", "--trace", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
    assert "trace not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["plan", "--trace", str(bad), "--no-progress"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_cli_sim_curve_prints_the_prediction_and_embeds_the_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", random_trace(6, 300))
    html = tmp_path / "r.html"
    argv = ["sim", "--trace", str(trace), "--device-tokens", "200k", "--host-tokens", "800k", "--l3-backend", "none"]
    assert run_cli([*argv, "--curve", "--html", str(html), "--no-progress"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("curve"))
    assert "LRU prediction for these sizes" in line and "replayed" in line
    text = html.read_text()
    assert "one pass" in text and text.count("data:image/png;base64") == 4  # three plots and the curve


# ----------------------------------------------------------------------------- TTFT targets
def _chat_curve() -> CapacityCurve:
    return CapacityCurve.from_requests(ChatWorkload(requests=300, seed=3), page_size=16)


def test_request_hits_add_up_to_the_curve_at_every_capacity() -> None:
    curve = _chat_curve()
    for tokens in (0, 16, 5_000, 40_000, curve.max_useful_tokens // 2, curve.max_useful_tokens):
        hits = curve.request_hit_tokens(tokens)
        assert hits.shape == (curve.requests,) and hits.min() >= 0
        assert int(hits.sum()) == int(curve.token_hits[min(tokens // 16, curve.max_pages)])
        assert np.all(hits <= curve.request_pages * 16)


def test_ttft_per_request_uses_each_tiers_hits() -> None:
    from hiradix.sim.timing import LINKS, TimingModel

    curve = _chat_curve()
    timing = TimingModel(l3=LINKS["tcp"])
    d, h, top = 20_000, 60_000, curve.max_useful_tokens
    dh, hh, th = (curve.request_hit_tokens(x) for x in (d, h, top))
    expect = timing.ttft(curve.request_inputs, dh, hh - dh, th - hh)
    assert np.array_equal(curve.ttft(timing, d, h, top), expect)
    assert np.all(curve.ttft(timing, top) <= curve.ttft(timing, 0))  # all on the device beats none


def test_recommend_for_ttft_meets_the_target_at_the_smallest_size_tried() -> None:
    from hiradix.sim.curve import recommend_for_ttft
    from hiradix.sim.timing import LINKS, TimingModel

    curve = _chat_curve()
    timing = TimingModel(l3=LINKS["rdma"])
    none = float(np.percentile(curve.ttft(timing, 0), 90))
    best = float(np.percentile(curve.ttft(timing, curve.max_useful_tokens), 90))
    target = best + 0.5 * (none - best)
    plans = recommend_for_ttft(curve, timing, target, bytes_per_token=131_072)
    assert plans and [p.cost for p in plans] == sorted(p.cost for p in plans)
    for plan in plans:
        assert plan.ttft_s is not None and plan.ttft_s <= target
        got = np.percentile(curve.ttft(timing, plan.device_tokens, plan.host_tokens, plan.l3_tokens), 90)
        assert got == pytest.approx(plan.ttft_s)
    device_only = next(p for p in plans if p.layout == "device")
    smaller = max(curve.max_prompt_tokens, device_only.device_tokens // 2)
    if smaller < device_only.device_tokens:
        assert np.percentile(curve.ttft(timing, smaller), 90) > target or smaller == curve.max_prompt_tokens
    assert recommend_for_ttft(curve, timing, best / 10, bytes_per_token=131_072) == []
    with pytest.raises(ValueError, match="TTFT"):
        recommend_for_ttft(curve, timing, 0, bytes_per_token=131_072)


def test_cli_plan_for_a_ttft_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", random_trace(6, 300))
    base = ["plan", "--trace", str(trace), "--no-progress"]
    assert run_cli([*base, "--target-p90-ttft", "10", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "p90 TTFT of at most 10 s" in out and "recommended" in out
    assert any(line.rstrip().endswith(" s") and "p90 TTFT" in line for line in out.splitlines()[1:])
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["target_p90_ttft_s"] == 10 and data["plans"][0]["ttft_s"] <= 10
    assert run_cli([*base, "--target-p90-ttft", "0.000001"]) == 2
    assert "no layout reaches a p90 TTFT" in capsys.readouterr().err
    assert run_cli([*base, "--target-p90-ttft", "1", "--target-hit-rate", "10%"]) == 2
    assert "not both" in capsys.readouterr().err

"""Workload generators: deterministic for a seed, valid trace records with prefix
semantics, the sharing each workload promises, the Azure CSV reader and its errors, and
replays of generated workloads (reaching the ideal when unbounded, monotone in
capacity under LRU). Workloads are a few hundred requests, so both tree
implementations run every test in well under a second each."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hiradix.cli import SHARED_TRACE
from hiradix.sim import BLOCK_TOKENS, Replayer, TraceError, parse_line
from hiradix.sim.generators import (
    AZURE_FILES,
    AgentWorkload,
    AzureWorkload,
    ChatWorkload,
    MooncakeWorkload,
    SystemPromptWorkload,
    Workload,
    _BlockIds,
    _Context,
    make_workload,
    read_azure_csv,
)

AZURE_DIR = SHARED_TRACE.parent

AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,1396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:52.0000000,3000,8
"""  # the first rows of AzureLLMInferenceTrace_conv.csv (CC-BY-4.0), lengths of rows 2 and 5 changed


@pytest.fixture
def azure_csv(tmp_path: Path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_CSV)
    return path


def synthetic_workloads(azure: Path) -> list[Workload]:
    return [
        SystemPromptWorkload(requests=300, seed=3),
        ChatWorkload(requests=300, seed=3),
        AgentWorkload(requests=300, seed=3),
        AzureWorkload(azure, seed=3, prefix_tokens=(100, 2000)),
    ]


IDS = ["system-prompt", "chat", "agent", "azure"]


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_a_workload_is_deterministic_for_a_seed(azure_csv: Path, index: int) -> None:
    workload = synthetic_workloads(azure_csv)[index]
    first = list(workload)
    assert first == list(workload)  # iterating again
    assert list(pickle.loads(pickle.dumps(workload))) == first  # as a spawned sweep worker gets it
    assert list(dataclasses.replace(workload, seed=4)) != first


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_generated_requests_are_valid_trace_records(azure_csv: Path, index: int) -> None:
    """Each record survives the trace parser, times are sorted, lines count from 1,
    and a block id always names the same prefix (the trace's prefix semantics)."""
    requests = list(synthetic_workloads(azure_csv)[index])
    assert [r.line for r in requests] == list(range(1, len(requests) + 1))
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in requests:
        record = {k: getattr(r, k) for k in ("timestamp", "input_length", "output_length")}
        assert parse_line(json.dumps({**record, "hash_ids": list(r.hash_ids)}), r.line) == r
        assert r.input_length > 0 and len(r.hash_ids) == math.ceil(r.input_length / BLOCK_TOKENS)
        for i, h in enumerate(r.hash_ids):
            assert prefix_of.setdefault(h, r.hash_ids[:i]) == r.hash_ids[:i]


def test_context_shares_full_blocks_and_renames_a_changed_tail() -> None:
    ids = _BlockIds()
    system = _Context(ids)
    system.append(1100)  # two full blocks and a 76-token tail
    assert system.hash_ids() == (0, 1, 2) and system.hash_ids() == (0, 1, 2)
    a, b = system.fork(), system.fork()
    assert a.hash_ids() == (0, 1, 2)  # same content, same tail id
    a.append(10)
    assert a.hash_ids() == (0, 1, 3)  # the tail changed: a new id
    b.append(600)
    assert b.hash_ids() == (0, 1, 4, 5)  # block 2 completed (new id), then a new tail
    assert system.fork(700).hash_ids() == (0, 6)  # a cut inside a block: a new partial tail
    assert system.fork(1024).hash_ids() == (0, 1)


def test_chat_turns_resend_the_conversation() -> None:
    """Sequential conversations (rare starts, quick turns) of exactly 3 turns: each
    turn's prompt holds every full block of the previous turn's, grown by the answer
    and a new message; conversations share only the system prompt."""
    workload = ChatWorkload(requests=30, seed=1, system_prompts=1, turns=(3, 3), think_time_s=(0.001, 0.001), rate=1e-6)
    requests = list(workload)
    for k in range(0, 30, 3):
        a, b, c = requests[k : k + 3]
        for earlier, later in ((a, b), (b, c)):
            full = earlier.input_length // BLOCK_TOKENS
            assert later.hash_ids[:full] == earlier.hash_ids[:full]
            assert later.input_length >= earlier.input_length + earlier.output_length + 20
    firsts = [requests[k] for k in range(0, 30, 3)]
    shared = min(len(set(r.hash_ids[:n] for r in firsts)) for n in (1,))
    assert shared == 1  # the one system prompt's first block
    assert len({r.hash_ids[-1] for r in firsts}) == 10


def test_agent_steps_resend_the_context_grown_by_action_and_tool_output() -> None:
    """Sequential sessions (rare starts, instant tools) of exactly 4 steps: each step's
    prompt holds every full block of the previous one, grown by the action and the tool
    output."""
    workload = AgentWorkload(
        requests=40, seed=1, agents=1, steps=(4, 4), tool_tokens=(100, 3000), tool_latency_s=(0.001, 0.001), rate=1e-6
    )
    requests = list(workload)
    for k in range(0, 40, 4):
        for earlier, later in zip(requests[k : k + 3], requests[k + 1 : k + 4], strict=True):
            full = earlier.input_length // BLOCK_TOKENS
            assert later.hash_ids[:full] == earlier.hash_ids[:full]
            assert later.input_length >= earlier.input_length + earlier.output_length + 100


def test_agent_sessions_end_at_max_context() -> None:
    workload = AgentWorkload(requests=400, seed=2, max_context=20_000, system_tokens=(2000, 4000), steps=(30, 30))
    requests = list(workload)
    assert len(requests) == 400  # sessions cut short are replaced by new ones
    assert max(r.input_length for r in requests) <= 20_000


def test_system_prompts_follow_zipf_popularity() -> None:
    requests = list(SystemPromptWorkload(requests=2000, seed=0, prompts=8, skew=1.2))
    counts: dict[int, int] = {}
    for r in requests:
        counts[r.hash_ids[0]] = counts.get(r.hash_ids[0], 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert len(ranked) == 8 and ranked[0] > 3 * ranked[-1]


def test_azure_workload_takes_arrivals_and_lengths_verbatim(azure_csv: Path) -> None:
    requests = list(AzureWorkload(azure_csv, prefixes=1, prefix_tokens=(1000, 1000)))
    assert [r.input_length for r in requests] == [374, 1396, 879, 91, 3000]
    assert [r.output_length for r in requests] == [44, 109, 55, 16, 8]
    assert requests[0].timestamp == 0.0 and requests[1].timestamp == pytest.approx(4314.579)
    # One 1000-token prefix: prompts longer than it share its first full block.
    assert requests[1].hash_ids[0] == requests[4].hash_ids[0]
    assert requests[1].hash_ids[1] != requests[4].hash_ids[1]  # its tail is cut differently
    limited = list(AzureWorkload(azure_csv, requests=2, time_scale=0.5))
    assert len(limited) == 2 and limited[1].timestamp == pytest.approx(4314.579 / 2)


@pytest.mark.skipif(not (AZURE_DIR / AZURE_FILES["azure-conv"]).is_file(), reason=f"no Azure traces in {AZURE_DIR}")
@pytest.mark.parametrize("name", sorted(AZURE_FILES))
def test_the_real_azure_traces_read(name: str) -> None:
    lengths = read_azure_csv(AZURE_DIR / AZURE_FILES[name])
    assert len(lengths) == {"azure-conv": 19366, "azure-code": 8819}[name]
    assert lengths.timestamps_ms[0] == 0 and np.all(np.diff(lengths.timestamps_ms) >= 0)
    assert 3400 < lengths.timestamps_ms[-1] / 1000 < 3600  # about an hour
    workload = make_workload(name, trace_dir=AZURE_DIR, requests=100)
    assert len(list(workload)) == 100


BAD_CSV = {
    "expected the header": ("TIME,Context,Generated\n", 1),
    "expected 3 comma-separated fields": ("2023-11-16 18:15:46.6805900,374\n", 2),
    "invalid literal for int": ("2023-11-16 18:15:46.6805900,3x4,44\n", 2),
    "bad TIMESTAMP": ("16/11/2023 18:15,374,44\n", 2),
    "negative token count": ("2023-11-16 18:15:46.6805900,-1,44\n", 2),
    "goes backwards": ("2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:45.0,374,44\n", 3),
}


@pytest.mark.parametrize("problem", sorted(BAD_CSV))
def test_a_malformed_azure_csv_is_rejected_with_its_line(tmp_path: Path, problem: str) -> None:
    text, line = BAD_CSV[problem]
    path = tmp_path / "bad.csv"
    path.write_text(text if problem == "expected the header" else "TIMESTAMP,ContextTokens,GeneratedTokens\n" + text)
    with pytest.raises(TraceError) as info:
        list(AzureWorkload(path))
    assert info.value.line == line and problem in str(info.value)


def test_a_missing_azure_trace_says_where_it_belongs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"Azure trace not found: .*AzurePublicDataset"):
        list(AzureWorkload(tmp_path / "nope.csv"))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ChatWorkload(requests=-1), "requests must be >= 0"),
        (lambda: ChatWorkload(rate=0), "rate must be > 0"),
        (lambda: ChatWorkload(user_tokens=(10, 5)), "user_tokens must be a range"),
        (lambda: AgentWorkload(max_context=1000), "cannot hold"),
        (lambda: SystemPromptWorkload(prompts=0), "prompts must be >= 1"),
        (lambda: make_workload("nope", trace_dir="."), "unknown workload 'nope'"),
    ],
)
def test_bad_parameters_are_rejected(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_make_workload_fills_in_paths_and_sizes(tmp_path: Path) -> None:
    trace = make_workload("trace", trace_dir=tmp_path, requests=5)
    assert isinstance(trace, MooncakeWorkload) and trace.path == tmp_path / "conversation_trace.jsonl"
    assert trace.limit == 5
    azure = make_workload("azure-code", trace_dir=tmp_path)
    assert isinstance(azure, AzureWorkload) and azure.path.name == AZURE_FILES["azure-code"]
    assert azure.describe()["workload"] == "azure-code"
    chat = make_workload("chat", trace_dir=tmp_path, requests=7, seed=9)
    assert chat == ChatWorkload(requests=7, seed=9) and len(list(chat)) == 7
    assert make_workload("agent", trace_dir=tmp_path).describe()["requests"] == 2000


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_unbounded_replay_of_a_generated_workload_reaches_the_ideal(tree_cls: Any, azure_csv: Path, index: int) -> None:
    workload = synthetic_workloads(azure_csv)[index]
    stats = Replayer(tree_cls, page_size=16, check_every=50).replay(workload)
    assert stats.device_hit_tokens == stats.ideal_hit_tokens
    assert stats.device_hit_blocks == stats.ideal_hit_blocks
    if index < 3:
        assert stats.rates()["ideal_token_hit_rate"] > 0.3  # these workloads share a lot


@pytest.mark.parametrize("index", range(3), ids=IDS[:3])
def test_hit_rate_is_monotone_in_capacity_on_a_generated_workload(azure_csv: Path, index: int) -> None:
    """Under LRU, more device (no host) or more host (fixed device) never hits less."""
    workload = synthetic_workloads(azure_csv)[index]
    big = max(r.input_length for r in workload) + 16

    def hits(device: int | None, host: int | None) -> int:
        stats = Replayer(device_tokens=device, host_tokens=host).replay(workload)
        assert stats.too_large_requests == 0
        return stats.device_hit_tokens + stats.host_hit_tokens

    by_device = [hits(d, 0) for d in (big, 2 * big, 4 * big, 8 * big, None)]
    assert by_device == sorted(by_device) and by_device[0] < by_device[-1], by_device
    by_host = [hits(big, h) for h in (0, big, 4 * big, 16 * big, None)]
    assert by_host == sorted(by_host) and by_host[0] < by_host[-1], by_host

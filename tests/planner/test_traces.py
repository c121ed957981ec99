"""The trace readers: the three formats into one workload, and clear errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.traces import TraceError, read_trace

CONVERSATIONS = [
    {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "a" * 400},
            {"role": "assistant", "content": "b" * 80},
            {"role": "user", "content": "c" * 200},
            {"role": "assistant", "content": "d" * 40},
        ],
    },
    {
        "id": "c2",
        "messages": [{"role": "user", "content": "e" * 8}, {"role": "assistant", "content": "f" * 4}],
    },
]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_vllm_conversations_become_turns_whose_prompt_holds_the_previous_context(tmp_path: Path) -> None:
    w = read_trace(_write(tmp_path, "c.json", json.dumps(CONVERSATIONS)), "vllm", chars_per_token=4)
    assert not w.timed and w.conversations == 2
    first, second, other = w.turns
    assert (first.prompt_tokens, first.output_tokens, first.shared_tokens) == (100, 20, 0)
    # the second turn's prompt: the first prompt, its answer and the new user message
    assert (second.index, second.prompt_tokens, second.output_tokens, second.shared_tokens) == (
        1,
        170,
        10,
        120,
    )
    assert (other.conversation, other.index) == ("c2", 0)


def test_vllm_generation_config_draws_the_same_sizes_for_the_same_seed(tmp_path: Path) -> None:
    config = {
        "filetype": "generate_conversations",
        "num_conversations": 5,
        "prompt_input": {
            "num_turns": {"distribution": "uniform", "min": 4, "max": 8},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
            "prefix_num_tokens": {"distribution": "lognormal", "average": 1000, "max": 5000},
            "num_tokens": {"distribution": "uniform", "min": 120, "max": 160},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 80, "max": 120}},
    }
    path = _write(tmp_path, "g.json", json.dumps(config))
    a, b = read_trace(path, "vllm", seed=3), read_trace(path, "vllm", seed=3)
    assert a == b and a.conversations == 5
    assert all(t.prompt_tokens >= 500 + 120 and 80 <= t.output_tokens <= 120 for t in a.turns)
    assert all(2 <= sum(t.conversation == c for t in a.turns) <= 4 for c in {t.conversation for t in a.turns})


def test_mooncake_requests_sharing_a_prefix_continue_a_conversation(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [9, 10]},
        {"timestamp": 3000, "input_length": 1600, "output_length": 20, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 5000, "input_length": 700, "output_length": 5, "hash_ids": [1, 7]},
    ]
    w = read_trace(_write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines)), "mooncake")
    assert w.timed
    by_time = {(t.arrival_s, t.prompt_tokens): t for t in w.turns}
    follow = by_time[(3.0, 1600)]
    assert (follow.index, follow.shared_tokens) == (1, 1024)  # two 512-token blocks in common
    assert follow.conversation == by_time[(0.0, 1000)].conversation
    branch = by_time[(5.0, 700)]  # one block in common with the conversation's last turn
    assert (branch.conversation, branch.index, branch.shared_tokens) == (follow.conversation, 2, 512)
    alone = by_time[(0.0, 600)]
    assert (alone.index, alone.shared_tokens) == (0, 0) and alone.conversation != follow.conversation


def test_mooncake_session_ids_name_the_conversation(tmp_path: Path) -> None:
    lines = [
        {"session_id": "s", "timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]},
        {"session_id": "s", "timestamp": 10, "input_length": 900, "output_length": 10, "hash_ids": [1, 2, 3]},
    ]
    w = read_trace(_write(tmp_path, "m.jsonl", "\n".join(json.dumps(x) for x in lines)), "mooncake")
    assert [(t.conversation, t.index, t.shared_tokens) for t in w.turns] == [("s", 0, 0), ("s", 1, 610)]


def test_kvferry_trace_keeps_the_measured_reuse_and_think_times(tmp_path: Path) -> None:
    lines = [
        {"kvferry_trace": 1, "salt_per_file": True},
        {"t": 100.0, "tenant": "", "conversation": "x", "turn": 0, "prompt_tokens": 1000, "output_tokens": 20,
         "reused_tokens": 0, "decision": "RECOMPUTE", "ttft_ms": 80.0, "latency_ms": 120.0},
        {"t": 100.5, "tenant": "", "conversation": "x", "turn": 1, "prompt_tokens": 1500, "output_tokens": 20,
         "reused_tokens": 1008, "decision": "PULL", "ttft_ms": 40.0, "latency_ms": 90.0},
        {"t": 101.0, "tenant": "", "conversation": "x", "turn": 2, "prompt_tokens": 2000, "output_tokens": 20,
         "reused_tokens": 0, "decision": "SKIPPED", "reason": "daemon_timeout", "ttft_ms": 90.0,
         "latency_ms": 130.0},
    ]  # fmt: skip
    w = read_trace(_write(tmp_path, "k.jsonl", "\n".join(json.dumps(x) for x in lines)), "kvferry")
    first, second, third = w.turns
    assert (first.arrival_s, second.arrival_s) == (0.0, 0.5)
    assert second.shared_tokens == 1020 and second.think_s == pytest.approx(0.38)
    assert second.measured is not None and second.measured.reused_tokens == 1008
    assert second.measured.reason == "" and not second.measured.skipped_for_the_run  # (no reason: older)
    assert third.measured is not None and third.measured.skipped_for_the_run


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,',
            "t.jsonl:2: not JSON",
        ),
        (
            "mooncake",
            '{"timestamp": "soon", "input_length": 5, "output_length": 1}',
            "t.jsonl:1: 'timestamp'",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 0, "output_length": 1}',
            "'input_length' must be an integer >= 1",
        ),
        ("kvferry", '{"kvferry_trace": 2}', "t.jsonl:1: trace version 2"),
        (
            "kvferry",
            '{"t": 1, "conversation": "x", "turn": 0, "prompt_tokens": -1}',
            "t.jsonl:1: 'prompt_tokens'",
        ),
        ("kvferry", "", "no turns in the trace"),
        (
            "kvferry",
            '{"t": 1, "conversation": "x", "turn": 0, "prompt_tokens": 1, "output_tokens": 1, '
            '"reused_tokens": 0, "reason": 3}',
            "t.jsonl:1: 'reason' must be a string, not 3",
        ),
        (
            "vllm",
            '[{"id": "a", "messages": []}]',
            "conversation 0 ('a'): 'messages' must be a non-empty list",
        ),
        (
            "vllm",
            '[{"id": "a", "messages": [{"role": "user"}]}]',
            "conversation 0 message 0: needs a string 'content'",
        ),
        ("vllm", '{"filetype": "generate_conversations"}', "generation config lacks or mistypes"),
        ("vllm", "[1,", "t.jsonl:1: not JSON"),
        ("csv", "", "unknown trace format 'csv'"),
    ],
)
def test_a_bad_trace_is_refused_naming_where_and_what(
    tmp_path: Path, fmt: str, text: str, message: str
) -> None:
    path = _write(tmp_path, "t.jsonl", text)
    with pytest.raises(TraceError) as caught:
        read_trace(path, fmt)
    assert message in str(caught.value)


def test_a_missing_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "none.jsonl", "kvferry")

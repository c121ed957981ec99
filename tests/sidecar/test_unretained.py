"""Turns D pins blocks for without saying which, and the ledger of those blocks. Pure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.capture import SseRewriter, TurnObserver, plan_request
from sidecar.unretained import (
    STREAM_WITHOUT_PARAMS,
    UnretainedLedger,
    computed_tokens,
    outcome_of,
    pinned_blocks,
    warning_detail,
)

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]]}


def _streamed(
    prompt: list[int] | None = None,
    output: tuple[list[int], ...] = ([7], [8]),
    finish: str = "stop",
    **last: Any,
) -> TurnObserver:
    """An observer fed a chat stream as vLLM 0.32 sends it (no kv_transfer_params)."""
    obs = TurnObserver(strip_token_ids=True)
    first: dict[str, Any] = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}
    if prompt is not None:
        first["prompt_token_ids"] = prompt
    obs.observe(first)
    for n, ids in enumerate(output, 1):
        choice: dict[str, Any] = {"index": 0, "delta": {"content": "x"}, "token_ids": ids}
        if n == len(output):
            choice |= {"finish_reason": finish, "stop_reason": None} | last
        obs.observe({"object": "chat.completion.chunk", "choices": [choice]})
    return obs


def _outcome(obs: TurnObserver, streamed: bool = True, with_prefill_params: bool = True) -> str:
    turn = obs.finished()
    assert isinstance(turn, str)
    return outcome_of(turn, obs, streamed=streamed, with_prefill_params=with_prefill_params)


def test_a_stream_without_params_to_a_prefills_request_is_told_apart() -> None:
    assert _outcome(_streamed([1, 2, 3])) == STREAM_WITHOUT_PARAMS
    assert _outcome(_streamed([1, 2, 3], finish="length")) == STREAM_WITHOUT_PARAMS
    assert _outcome(_streamed([1, 2, 3], finish="tool_calls")) == STREAM_WITHOUT_PARAMS
    # a stop token (its id) ends the request in the engine: pinned as any stop
    assert _outcome(_streamed([1, 2, 3], stop_reason=2)) == STREAM_WITHOUT_PARAMS


@pytest.mark.parametrize(
    ("obs", "streamed", "with_prefill_params", "why"),
    [
        # a JSON answer without params: no connector, or not bidirectional: nothing pinned
        (_streamed([1, 2]), False, True, "no_params"),
        # no prefill's params came: D pins nothing (the router sends none then)
        (_streamed([1, 2]), True, False, "no_params"),
        # a stop string: vLLM's front end aborts the request in the engine, which frees it
        (_streamed([1, 2], stop_reason="\n\n"), True, True, "no_params"),
        (_streamed([1, 2], finish="abort"), True, True, "abnormal_finish"),
        (_streamed([1, 2], finish="error"), True, True, "abnormal_finish"),
    ],
)
def test_other_answers_without_params_pin_nothing(
    obs: TurnObserver, streamed: bool, with_prefill_params: bool, why: str
) -> None:
    assert _outcome(obs, streamed, with_prefill_params) == why


def test_several_choices_errors_and_unfinished_streams_keep_their_labels() -> None:
    several = _streamed([1, 2])
    several.observe({"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}]})
    assert _outcome(several) == "several_choices"
    failed = _streamed([1, 2])
    failed.observe({"error": {"message": "boom", "code": 500}})
    assert _outcome(failed) == "engine_error"
    unfinished = TurnObserver(strip_token_ids=True)
    unfinished.observe({"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [1]}]})
    assert _outcome(unfinished) == "unfinished"


def test_a_request_names_a_prefills_params_as_vllm_reads_them() -> None:
    def plan(kv: Any, capture: bool = True) -> bool:
        raw = json.dumps({"conversation_id": "c", "kv_transfer_params": kv}).encode()
        got = plan_request("POST", "/v1/chat/completions", {}, raw, "X-Tenant", capture)
        assert got is not None
        return got.with_prefill_params

    assert plan(P_PARAMS) is True
    assert plan({**P_PARAMS, "do_remote_prefill": "yes"}) is True  # (truthy, as the connector reads it)
    assert plan({**P_PARAMS, "do_remote_prefill": False}) is False
    assert plan({"do_remote_decode": True}) is False  # a prefill node's own request
    assert plan(None) is False and plan("not an object") is False and plan([1]) is False
    assert plan(P_PARAMS, capture=False) is False
    raw = json.dumps({"conversation_id": "c"}).encode()
    got = plan_request("POST", "/v1/chat/completions", {}, raw, "X-Tenant")
    assert got is not None and got.with_prefill_params is False


def test_computed_tokens_from_ids_else_usage() -> None:
    # prompt + output - 1: the last token sampled is never fed back
    assert computed_tokens(_streamed([1, 2, 3], ([7], [8, 9]))) == 5
    no_ids = _streamed(None, ([], []))
    no_ids.output_token_ids = None
    assert computed_tokens(no_ids) is None
    no_ids.observe(
        {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49}}
    )
    assert computed_tokens(no_ids) == 48
    bad = TurnObserver(strip_token_ids=False)
    bad.observe({"choices": [], "usage": {"prompt_tokens": True, "completion_tokens": "9"}})
    assert bad.usage is None and computed_tokens(bad) is None


def test_computed_tokens_from_prompt_ids_cut_out_of_the_first_event() -> None:
    """The tap cuts the prompt's ids out of a stream's first event as bytes; they are
    counted, not decoded."""
    obs = TurnObserver(strip_token_ids=True)
    sse = SseRewriter(obs)
    ids = list(range(100, 164))
    events = [
        {"object": "chat.completion.chunk", "prompt_token_ids": ids, "choices": [{"index": 0, "delta": {}}]},
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [5]}],
        },
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [6], "finish_reason": "length"}],
        },
    ]
    out = sse.feed(
        b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events)
    )
    assert b"token_ids" not in out and obs.prompt_ids_json is not None and obs.prompt_token_ids is None
    assert computed_tokens(obs) == 64 + 2 - 1
    empty = TurnObserver(strip_token_ids=True, prompt_ids_json=b"[]", output_token_ids=[1])
    assert computed_tokens(empty) == 0


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_pinned_blocks(tokens: int, blocks: int) -> None:
    assert pinned_blocks(tokens, 16) == blocks


def test_the_ledger_frees_blocks_at_the_ttl_and_warns_once_per_engine_process() -> None:
    ledger = UnretainedLedger(ttl_s=10.0)
    assert ledger.blocks(0.0) == 0
    assert ledger.add(0, 3, finished_at=100.0) is True  # the first: warn
    assert ledger.add(0, 5, finished_at=104.0) is False
    assert ledger.add(0, 2, finished_at=102.0) is False  # (concluded out of order)
    assert ledger.blocks(105.0) == 10
    assert ledger.blocks(110.0) == 7  # the first turn's TTL ran out at 110
    assert ledger.blocks(113.0) == 5
    assert ledger.blocks(114.0) == 0
    assert ledger.turns == 3
    assert ledger.add(0, None, finished_at=120.0) is False  # blocks unknown: counted as a turn
    assert ledger.turns == 4 and ledger.blocks(120.0) == 0


def test_a_new_engine_process_holds_nothing_of_the_old_ones() -> None:
    ledger = UnretainedLedger(ttl_s=480.0)
    ledger.add(0, 7, finished_at=1.0)
    ledger.restart(1)
    assert ledger.blocks(2.0) == 0
    # a turn the old process finished, concluded after the restart: its blocks are gone
    assert ledger.add(0, 4, finished_at=1.5) is False and ledger.blocks(2.0) == 0
    assert ledger.add(1, 2, finished_at=3.0) is True  # the new process's first: warn again
    assert ledger.blocks(4.0) == 2 and ledger.turns == 3


def test_the_warning_tells_the_operator_what_happens_and_what_to_do() -> None:
    detail = warning_detail(480.0)
    for words in ("kv_transfer_params", "PR 40186", "recomputes", "480 s", "non-streamed", "pinned"):
        assert words in detail, words

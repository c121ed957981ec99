"""The tap's decisions: request rewrite, reading answers, SSE framing, drafting retentions. Pure."""

from __future__ import annotations

import array
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.digests import block_digests, seed
from kvferry.turnheaders import TENANT_HEADER
from sidecar.capture import (
    FinishedTurn,
    SseRewriter,
    TurnObserver,
    cut_prompt_ids,
    plan_request,
    rewrite_json,
)
from sidecar.drafts import (
    RetentionDraft,
    digests_of,
    draft_retention,
    is_loopback,
    rewrite_remote_host,
    wall_deadline,
)

TENANT = TENANT_HEADER


def _plan(body: Any, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions", **kw: Any):  # type: ignore[no-untyped-def]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return plan_request("POST", path, headers or {}, raw, TENANT, **kw)


def test_requests_without_a_conversation_pass_untouched() -> None:
    assert _plan({"messages": []}) is None
    assert _plan(b"{not json") is None
    # what the tap cannot decode goes to the engine as it came, for the engine to answer:
    # nested deeper than the decoder recurses, or a number too big for a float
    assert _plan(b'{"conversation_id": "c", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}") is None
    assert _plan(b'{"conversation_id": "c", "x": 1e400}') is None
    assert _plan(b'{"session_id": "a", "return_token_ids": false, "x": -1e999}') is None
    assert _plan([1, 2]) is None
    assert _plan({"conversation_id": "c"}, path="/tokenize") is None
    assert plan_request("GET", "/v1/chat/completions", {}, b"", TENANT) is None


def test_conversation_sources_in_order() -> None:
    body = {"conversation_id": "from-body", "session_id": "sess-body"}
    assert _plan(body, {"X-Conversation-Id": "hdr"}).conversation_id == "hdr"
    assert _plan(body, {"X-Session-ID": "sess-hdr"}).conversation_id == "from-body"
    assert _plan({"session_id": "sess-body"}, {"X-Session-ID": "sess-hdr"}).conversation_id == "sess-hdr"
    assert _plan({"session_id": "sess-body"}).conversation_id == "sess-body"
    assert _plan({"conversation_id": 42}).conversation_id == "42"
    assert _plan({"conversation_id": "  "}) is None


def test_the_request_id_is_kept_when_the_daemon_would_take_it() -> None:
    """The router's id of the turn goes with the retention, else (another front door) the
    X-Request-Id; a client's odd one is dropped rather than have the daemon refuse the
    registration for it."""
    body = {"conversation_id": "c"}
    turn = {"X-Kvferry-Turn-Id": "kvf-0123", "X-Request-Id": "agent-42"}
    assert _plan(body, turn).request_id == "kvf-0123"  # (the client's id, the same every turn)
    assert _plan(body, {"X-Request-Id": " kvf-0123 "}).request_id == "kvf-0123"
    assert _plan(body).request_id == ""
    assert _plan(body, {"X-Request-Id": "x" * 129}).request_id == ""
    assert _plan(body, {"X-Request-Id": "a\x01b"}).request_id == ""
    # (bytes that are not UTF-8 come from aiohttp as surrogates: no id, and no error)
    assert _plan(body, {"X-Request-Id": "a\udcffb"}).request_id == ""


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [], "kv_transfer_params": {"prompt_token_ids": [1, 2]}}',
        b'  \n {"model":"m"}',
        b"{}",
        b"{ }",
        b'{"return_token_ids": false, "x": 1}',
        b'{"return_token_ids": null}',
        b'{"conversation_id": 7, "x": [1]}',
    ],
)
def test_the_engine_gets_the_same_request_asking_for_token_ids(raw: bytes) -> None:
    plan = _plan(raw, {"X-Conversation-Id": "c"})
    assert plan is not None and plan.strip_token_ids
    original = json.loads(raw)
    original.pop("conversation_id", None)
    assert json.loads(plan.body) == {**original, "return_token_ids": True}


def test_an_echoing_completion_is_not_asked_for_token_ids() -> None:
    """vLLM echoes an empty prompt when return_token_ids is set: the client's echo wins,
    and the turn's retention goes without digests (unverifiable: never pulled unchecked)."""
    body = {"prompt": "Once upon", "echo": True, "max_tokens": 4}
    plan = _plan(body, {"X-Conversation-Id": "c"}, path="/v1/completions")
    assert plan is not None and plan.capture and not plan.strip_token_ids
    assert plan.body == json.dumps(body).encode()  # as it came
    plan = _plan({**body, "conversation_id": "c"}, path="/v1/completions")
    assert plan is not None and json.loads(plan.body) == body  # only the conversation id goes
    for echo_off, path in ((False, "/v1/completions"), (True, "/v1/chat/completions")):
        asked = _plan({**body, "echo": echo_off}, {"X-Conversation-Id": "c"}, path=path)
        assert asked is not None and json.loads(asked.body)["return_token_ids"] is True


def test_flags_are_read_as_vllm_reads_them() -> None:
    """vLLM's pydantic models take "true", 1, "off"... for a bool: a client that asked for
    token ids that way keeps them, and an echo turned off that way is no echo."""
    head = {"X-Conversation-Id": "c"}
    for asked in (True, 1, "true", "on"):
        plan = _plan({"messages": [], "return_token_ids": asked}, head)
        assert plan is not None and not plan.strip_token_ids, asked
    for not_asked in (False, 0, "false", "no", None):
        plan = _plan({"messages": [], "return_token_ids": not_asked}, head)
        assert plan is not None and plan.strip_token_ids, not_asked
        assert json.loads(plan.body)["return_token_ids"] is True
    for echo_off in ("false", 0, "OFF"):
        plan = _plan({"prompt": "p", "echo": echo_off}, head, path="/v1/completions")
        assert plan is not None and plan.strip_token_ids, echo_off  # ids asked: digests made
    plan = _plan({"prompt": "p", "echo": "yes"}, head, path="/v1/completions")
    assert plan is not None and not plan.strip_token_ids


def test_a_prefill_node_only_loses_the_body_conversation_id() -> None:
    plan = _plan({"conversation_id": "c", "x": 1}, capture=False)
    assert plan is not None and json.loads(plan.body) == {"x": 1} and not plan.strip_token_ids
    assert _plan({"x": 1}, {"X-Conversation-Id": "c"}, capture=False) is None  # nothing to remove


def test_the_body_sent_on() -> None:
    plan = _plan(
        {"model": "m", "conversation_id": "c", "session_id": "s", "messages": [], "stream": True},
        {TENANT: "acme"},
    )
    assert plan is not None and plan.tenant == "acme" and plan.model == "m" and plan.strip_token_ids
    sent = json.loads(plan.body)
    assert "conversation_id" not in sent and sent["session_id"] == "s" and sent["return_token_ids"] is True
    asked = _plan({"conversation_id": "c", "return_token_ids": True})
    assert asked is not None and not asked.strip_token_ids


def test_a_prefill_node_only_loses_the_conversation_field() -> None:
    plan = _plan({"conversation_id": "c", "messages": []}, capture=False)
    assert plan is not None and not plan.capture and not plan.strip_token_ids
    assert json.loads(plan.body) == {"messages": []}
    assert _plan({"messages": []}, {"X-Conversation-Id": "c"}, capture=False) is None


D_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_num_tokens": 40}


def _stream_chunks() -> list[dict[str, Any]]:
    return [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}], "prompt_token_ids": [1, 2, 3]},
        {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [7], "finish_reason": None}]},
        {
            "choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [8], "finish_reason": "stop"}],
            "kv_transfer_params": D_PARAMS,
        },
    ]


def test_observer_collects_a_streamed_turn_and_strips_ids() -> None:
    obs = TurnObserver(strip_token_ids=True)
    chunks = _stream_chunks()
    assert all(obs.observe(c) for c in chunks)
    assert not any("token_ids" in json.dumps(c) for c in chunks)
    turn = obs.finished()
    assert isinstance(turn, FinishedTurn)
    assert (turn.prompt_token_ids, turn.output_token_ids, turn.finish_reason) == ([1, 2, 3], [7, 8], "stop")
    kept = TurnObserver(strip_token_ids=False)
    chunks = _stream_chunks()
    assert not any(kept.observe(c) for c in chunks) and chunks[0]["prompt_token_ids"] == [1, 2, 3]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"finish_reason": "abort"}, "abnormal_finish"),
        ({"finish_reason": "error"}, "abnormal_finish"),
        ({"finish_reason": None}, "unfinished"),
        ({"params": {"do_remote_decode": False, "do_remote_prefill": True}}, "no_params"),
        ({"params": None}, "no_params"),
    ],
)
def test_only_normal_finishes_with_d_params_count(change: dict[str, Any], why: str) -> None:
    obs = TurnObserver(strip_token_ids=False)
    body: dict[str, Any] = {
        "choices": [{"index": 0, "message": {}, "finish_reason": change.get("finish_reason", "length")}],
        "kv_transfer_params": change.get("params", D_PARAMS),
    }
    obs.observe(body)
    assert obs.finished() == why
    err = TurnObserver(strip_token_ids=False)
    err.observe({"error": {"message": "boom", "code": 500}})
    assert err.finished() == "engine_error"


def test_a_tool_call_finish_leaves_a_retention() -> None:
    """vLLM's chat layer renames the engine's stop to "tool_calls" when the model called a tool;
    D still holds the blocks and returns its params (an agent's most common turn)."""
    obs = TurnObserver(strip_token_ids=False)
    obs.observe(
        {"choices": [{"index": 0, "message": {"tool_calls": []}, "finish_reason": "tool_calls"}],
         "kv_transfer_params": D_PARAMS}
    )  # fmt: skip
    turn = obs.finished()
    assert isinstance(turn, FinishedTurn) and turn.finish_reason == "tool_calls"


def test_json_answers_keep_their_bytes_unless_stripped() -> None:
    raw = json.dumps(
        {"choices": [{"index": 0, "finish_reason": "stop"}], "kv_transfer_params": D_PARAMS}
    ).encode()
    assert rewrite_json(raw, TurnObserver(strip_token_ids=True)) is raw
    with_ids = json.dumps(
        {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "finish_reason": "stop"}]}
    ).encode()
    out = json.loads(rewrite_json(with_ids, TurnObserver(strip_token_ids=True)))
    # (null, as vLLM answers a client that did not ask for them)
    assert out == {
        "prompt_token_ids": None,
        "choices": [{"index": 0, "token_ids": None, "finish_reason": "stop"}],
    }
    completion = json.dumps(
        {
            "choices": [
                {"index": 0, "text": "x", "prompt_token_ids": [1], "token_ids": [2], "finish_reason": "stop"}
            ]
        }
    ).encode()
    out = json.loads(rewrite_json(completion, TurnObserver(strip_token_ids=True)))
    assert out["choices"] == [
        {"index": 0, "text": "x", "prompt_token_ids": None, "token_ids": None, "finish_reason": "stop"}
    ]
    obs = TurnObserver(strip_token_ids=True)
    assert rewrite_json(b"<html>", obs) == b"<html>" and obs.finished() == "engine_error"


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@given(st.lists(st.integers(1, 400), min_size=1, max_size=30))
def test_sse_rewriting_does_not_depend_on_chunk_boundaries(cuts: list[int]) -> None:
    stream = _sse(_stream_chunks())
    pieces, at = [], 0
    for n in cuts:
        pieces.append(stream[at : at + n])
        at += n
    pieces.append(stream[at:])
    obs = TurnObserver(strip_token_ids=True)
    sse = SseRewriter(obs)
    out = b"".join(sse.feed(p) for p in pieces) + sse.flush()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and sse.done
    decoded = [msgspec.json.decode(e[len(b"data: ") :]) for e in events[:-1]]
    expected = _stream_chunks()
    reference = TurnObserver(strip_token_ids=True)
    for chunk in expected:
        reference.observe(chunk)
    assert decoded == expected
    assert isinstance(obs.finished(), FinishedTurn) and obs.finished() == reference.finished()


def test_sse_complete_events_are_released_at_once() -> None:
    sse = SseRewriter(TurnObserver(strip_token_ids=False))
    assert sse.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert sse.feed(b": 2}\n\n") == b'data: {"b": 2}\n\n'
    assert sse.feed(b": keep-alive comment\n\n") == b": keep-alive comment\n\n"
    assert sse.feed(b"data: tail") == b"" and sse.flush() == b"data: tail"
    crlf = SseRewriter(TurnObserver(strip_token_ids=True))
    assert crlf.feed(b'data: {"prompt_token_ids": [1]}\r\n\r\n') == b"data: {}\r\n\r\n"
    # A last event whose blank line never came is observed (and rewritten) like the others.
    obs = TurnObserver(strip_token_ids=True)
    last = SseRewriter(obs)
    assert last.feed(b'data: {"prompt_token_ids": [1, 2]}\n') == b""
    assert last.flush() == b"data: {}\n" and obs.prompt_token_ids == [1, 2]


def test_chunks_sent_only_for_token_ids_are_not_forwarded_to_a_client_that_did_not_ask() -> None:
    """vLLM sends an empty-delta chat chunk (a token that made no text yet) only when the
    request asked for return_token_ids: stripped of its ids it must go, as it never came."""

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "token_ids": [5], "finish_reason": finish}
        return {"object": "chat.completion.chunk", "choices": [choice], **more}

    events = [
        chunk({"role": "assistant", "content": ""}),  # the first chunk: kept
        chunk({"content": "a"}),
        chunk({}),  # a token a tool parser held back: sent only for the ids
        chunk({"content": ""}),  # a token that made no text yet: sent either way
        chunk({}, usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}),  # usage: kept
        chunk({}, finish="stop"),  # the finish: kept
    ]
    for strip, forwarded in ((True, [0, 1, 3, 4, 5]), (False, [0, 1, 2, 3, 4, 5])):
        obs = TurnObserver(strip_token_ids=strip)
        sse = SseRewriter(obs)
        out = sse.feed(_sse(events)) + sse.flush()
        got = [msgspec.json.decode(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
        assert [g["choices"][0]["delta"] for g in got] == [
            events[i]["choices"][0]["delta"] for i in forwarded
        ]
        assert obs.output_token_ids == [5] * 6  # every chunk's ids were taken all the same
        assert all(("token_ids" in g["choices"][0]) is not strip for g in got)
    assert (
        SseRewriter(TurnObserver(strip_token_ids=True)).feed(_sse([chunk({})])[: -len(b"data: [DONE]\n\n")])
        == b""
    )


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", True),
        ("10.0.0.7", False),
        ("d-1.pods.svc", False),
        ("fe80::1", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_remote_host_rewrite_keeps_everything_else() -> None:
    params = {"remote_host": "localhost", "remote_port": 5600, "future": [1]}
    out = rewrite_remote_host(params, "10.1.2.3")
    assert out == {"remote_host": "10.1.2.3", "remote_port": 5600, "future": [1]}
    assert params["remote_host"] == "localhost"  # not mutated
    routable = {"remote_host": "10.9.9.9"}
    assert rewrite_remote_host(routable, "10.1.2.3") is routable


def test_expiry_conversion() -> None:
    assert wall_deadline(1480.0, now_mono=1000.0, now_wall=1_700_000_000.0) == 1_700_000_480.0
    assert wall_deadline(990.0, 1000.0, 5000.0) == 4990.0  # past: the caller drops it
    assert wall_deadline(1000.0 + 7200, 1000.0, 5000.0) is None  # not our clock
    assert wall_deadline(None, 1000.0, 5000.0) is None and wall_deadline("soon", 0.0, 0.0) is None


def _turn(**params: Any) -> FinishedTurn:
    return FinishedTurn(
        {**D_PARAMS, "remote_host": "localhost", **params}, list(range(30)), [100, 101, 102], "stop"
    )


def _draft(turn: FinishedTurn, **changes: Any) -> RetentionDraft | str:
    """draft_retention at mono 1000 / wall 2000, with a 480 s blocks TTL unless changed."""
    kw: dict[str, Any] = {
        "tenant": "t",
        "conversation_id": "c",
        "model": "",
        "epoch": 0,
        "side_channel_host": "h",
        "now_mono": 1000.0,
        "now_wall": 2000.0,
        "blocks_ttl_s": 480.0,
    }
    return draft_retention(turn, **{**kw, **changes})


def test_draft_from_a_finished_turn() -> None:
    draft = _draft(
        _turn(remote_num_tokens=32, remote_blocks_expiry_time=1480.0), epoch=3, side_channel_host="10.0.0.5"
    )
    assert isinstance(draft, RetentionDraft)
    assert draft.num_tokens == 32 and draft.expires_at == 2480.0 and draft.epoch == 3
    assert draft.tokens is not None and draft.params["remote_host"] == "10.0.0.5"
    assert list(draft.tokens) == [*range(30), 100, 101]
    assert isinstance(draft.tokens, array.array) and draft.tokens.itemsize == 4  # (queued: compact)
    assert digests_of(draft, "base", 16) == block_digests(draft.tokens, 16, seed("base"))
    lora = RetentionDraft(**{**draft.__dict__, "model": "my-lora"})
    assert digests_of(lora, "base", 16) == block_digests(draft.tokens, 16, seed("base", "my-lora"))
    same = RetentionDraft(**{**draft.__dict__, "model": "base"})
    assert digests_of(same, "base", 16) == digests_of(draft, "base", 16)
    assert digests_of(RetentionDraft(**{**draft.__dict__, "tokens": None}), "base", 16) == b""
    odd = FinishedTurn({**D_PARAMS, "remote_num_tokens": 32}, [-1, *range(31)], [1], "stop")
    unverifiable = _draft(odd)  # ids no engine sends: kept without them (no digests)
    assert isinstance(unverifiable, RetentionDraft) and unverifiable.tokens is None


def test_a_draft_without_ds_deadline_gets_one_at_capture() -> None:
    """Releases before remote_blocks_expiry_time: D holds the blocks its TTL from now, so the
    draft's deadline is stamped here, not left to the daemon at (maybe much later) registration."""
    draft = _draft(_turn(remote_num_tokens=32), blocks_ttl_s=300.0)
    assert isinstance(draft, RetentionDraft) and draft.expires_at == 2300.0
    # From when D's params came, not from the end of a stream a slow client read long after.
    seen = FinishedTurn(D_PARAMS, None, None, "stop", params_seen_at=1900.0)
    draft = _draft(seen, blocks_ttl_s=300.0)
    assert isinstance(draft, RetentionDraft) and draft.expires_at == 2200.0


def test_no_deadline_beyond_ds_blocks_ttl() -> None:
    """D frees the blocks its TTL after finishing, whatever its clock says: a deadline
    further off (an engine whose perf_counter is not this host's) is not believed."""
    draft = _draft(_turn(remote_num_tokens=32, remote_blocks_expiry_time=1000.0 + 3000))
    assert isinstance(draft, RetentionDraft) and draft.expires_at == 2000.0 + 480


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"remote_num_tokens": 0}, "no_tokens"),
        ({"remote_num_tokens": "many"}, "no_tokens"),
        ({"remote_blocks_expiry_time": 999.0}, "expired"),
    ],
)
def test_no_draft(params: dict[str, Any], why: str) -> None:
    got = _draft(_turn(**params), tenant="")
    assert got == why


@given(
    st.lists(st.integers(0, 1 << 31), max_size=50),
    st.permutations(["prompt_token_ids", "id", "choices", "kv_transfer_params"]),
)
def test_prompt_ids_cut_from_compact_events_as_if_decoded(ids: list[int], order: list[str]) -> None:
    """vLLM's compact first event loses its prompt ids by a byte cut: the client gets the
    same event, the finished turn the same ids, as through the decode-everything path."""
    fields: dict[str, Any] = {
        "prompt_token_ids": ids,
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "delta": {"content": '"prompt_token_ids":[1]'}, "finish_reason": "stop"}],
        "kv_transfer_params": D_PARAMS,
    }
    event = {k: fields[k] for k in order}
    compact, spaced = msgspec.json.encode(event), json.dumps(event).encode()
    assert compact.count(b'"prompt_token_ids":[') == 1 and b'"prompt_token_ids":[' not in spaced
    outputs, turns = [], []
    for payload in (compact, spaced):
        obs = TurnObserver(strip_token_ids=True)
        outputs.append(msgspec.json.decode(SseRewriter(obs).feed(b"data: " + payload + b"\n\n")[6:]))
        turns.append(obs.finished())
    assert outputs[0] == outputs[1] == {k: v for k, v in event.items() if k != "prompt_token_ids"}
    assert isinstance(turns[0], FinishedTurn) and turns[0] == turns[1] and turns[0].prompt_token_ids == ids


@pytest.mark.parametrize(
    "payload",
    [
        b'{"prompt_token_ids":[1,-2],"a":1}',  # not plain non-negative integers
        b'{"prompt_token_ids":[1.5],"a":1}',
        b'{"prompt_token_ids":[1],"choices":[{"prompt_token_ids":[1]}]}',  # more than one
        b'{"prompt_token_ids":null}',
        b'{"prompt_token_ids": [1]}',  # not compact: decoded the usual way
        b'{"\\"prompt_token_ids":[1]}',  # a key ending in an escaped quote
    ],
)
def test_prompt_ids_are_only_cut_when_plainly_safe(payload: bytes) -> None:
    assert cut_prompt_ids(payload) is None
    assert cut_prompt_ids(b'{"prompt_token_ids":[1,2]}') == (b"{}", b"[1,2]")


def test_completions_stream_ids_in_the_choice_are_cut_too() -> None:
    """vLLM's /v1/completions stream carries the prompt's ids in choice 0."""
    event = {
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": "a", "prompt_token_ids": [5, 6], "token_ids": [7]}],
    }
    obs = TurnObserver(strip_token_ids=True)
    out = SseRewriter(obs).feed(b"data: " + msgspec.json.encode(event) + b"\n\n")
    assert msgspec.json.decode(out[6:]) == {"id": "cmpl-1", "choices": [{"index": 0, "text": "a"}]}
    final = {
        "choices": [{"index": 0, "text": "", "token_ids": [8], "finish_reason": "stop"}],
        "kv_transfer_params": D_PARAMS,
    }
    SseRewriter(obs).feed(b"data: " + msgspec.json.encode(final) + b"\n\n")
    turn = obs.finished()
    assert (
        isinstance(turn, FinishedTurn) and turn.prompt_token_ids == [5, 6] and turn.output_token_ids == [7, 8]
    )

"""Pure decisions of the router about what P and D get: the daemon's params handed to P,
the bodies sent, the relay's scrubbing, tokenize requests, which inputs can be verified,
and the settings flags make."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.digests import block_digests, seed
from kvferry.releases import release_body, released, tick_body
from kvferry.verification import Held
from router.decisions import (
    LookupAnswer,
    decode_body,
    prefill_body,
    prefill_kv_params,
    reproducible,
    reuse_of,
    text_only,
    verified_reuse,
)
from router.relay import SseScrubber, scrub_json
from router.settings import Settings, add_arguments, from_args
from router.upstream import tokenize_request, tokens_of

D_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "d1",
    "remote_request_id": "r1",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "remote_num_tokens": 40,
}


# -- what the daemon's answer means for P ------------------------------------------------------


def test_a_pull_hands_p_the_daemons_params() -> None:
    reuse = reuse_of(LookupAnswer(True, "pull", D_PARAMS, {}, 40))
    assert reuse.pull and reuse.remote == D_PARAMS and reuse.reusable_tokens == 40
    kv = prefill_kv_params(reuse, [1, 2, 3])
    assert kv == {**D_PARAMS, "prompt_token_ids": [1, 2, 3]}


def test_a_recompute_with_release_params_frees_ds_blocks() -> None:
    release = {**D_PARAMS, "remote_num_tokens": 0}
    reuse = reuse_of(LookupAnswer(False, "below_threshold", {}, release, 0))
    assert not reuse.pull and reuse.remote == release
    assert prefill_kv_params(reuse, None)["remote_num_tokens"] == 0


def test_a_claim_answered_late_is_released_through_p_with_nothing_to_pull() -> None:
    """P, handed D's params with remote_num_tokens 0, pulls nothing and notifies D, which
    frees the blocks: the same for a late pull's params as for a release's."""
    for params in (D_PARAMS, {**D_PARAMS, "remote_num_tokens": 0, "prompt_token_ids": [1, 2]}):
        body = release_body("m", params)
        kv = body["kv_transfer_params"]
        # a prefill's params, in a request vLLM refuses before admission (stream with beam
        # search): its connector notifies the holder, and the engine allocates nothing
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert (body["stream"], body["use_beam_search"]) == (True, True)
        assert kv["remote_num_tokens"] == 0 and "prompt_token_ids" not in kv
        assert kv["remote_block_ids"] == D_PARAMS["remote_block_ids"]
        assert kv["remote_request_id"] == "r1" and kv["remote_engine_id"] == "d1"
        assert (body["model"], body["max_tokens"]) == ("m", 1)
        assert body["prompt"]
    assert "model" not in release_body(None, D_PARAMS)
    assert released(400) and not released(200) and not released(404)
    assert "kv_transfer_params" not in tick_body("m") and tick_body("m")["stream"] is False


def test_nothing_to_hand_over_means_fresh_params() -> None:
    reuse = reuse_of(LookupAnswer(False, "no_lease", {}, {}, 0))
    assert reuse.remote is None and reuse.decision == "RECOMPUTE"
    assert prefill_kv_params(reuse, [7]) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "prompt_token_ids": [7],
    }
    assert prefill_kv_params(None, None) == {"do_remote_decode": True, "do_remote_prefill": False}


def test_a_pull_missing_what_p_needs_is_not_handed_over() -> None:
    broken = {k: v for k, v in D_PARAMS.items() if k != "remote_host"}
    reuse = reuse_of(LookupAnswer(True, "pull", broken, {}, 40))
    assert not reuse.pull and reuse.remote is None and reuse.reason == "unusable_params"
    # Nothing to pull, but the claim took D's blocks: they are released (nothing pulled).
    empty = reuse_of(LookupAnswer(True, "pull", D_PARAMS, {}, 0))
    assert not empty.pull and empty.remote == {**D_PARAMS, "remote_num_tokens": 0}


# -- an answer whose prompt the router verifies itself (caller_verifies) -----------------------

_SEED = seed("m")
_HELD = list(range(100))  # D's 100 tokens: 6 full blocks of 16 (digested), 4 more
_WHOLE = {**D_PARAMS, "remote_block_ids": [list(range(1, 8)), list(range(11, 18))], "remote_num_tokens": 100}


def _claimed(whole_only: bool = False, threshold: int = 16) -> LookupAnswer:
    check = Held(100, 16, block_digests(_HELD, 16, _SEED), whole_only)
    return LookupAnswer(True, "pull", _WHOLE, {}, 100, check, threshold)


def _prompt(tokens: list[int]) -> tuple[int, bytes]:
    return len(tokens), block_digests(tokens, 16, _SEED)


def test_a_verified_prompt_pulls_what_its_digests_match_and_no_more() -> None:
    """The prompt differs from D's sequence in its 4th block: 3 blocks are pulled, every
    block list of D's cut to them (P takes D's blocks from each list's tail)."""
    edited = _HELD[:50] + [7] * 60
    reuse = verified_reuse(_claimed(), _prompt(edited))
    assert (reuse.decision, reuse.reason, reuse.reusable_tokens) == ("PULL", "partial_pull", 48)
    assert reuse.remote == {**_WHOLE, "remote_num_tokens": 48, "remote_block_ids": [[1, 2, 3], [11, 12, 13]]}
    # D's whole sequence and more: the full blocks both digested (D's partial last block never is)
    whole = verified_reuse(_claimed(), _prompt(_HELD + [5] * 40))
    assert (whole.reason, whole.reusable_tokens) == ("partial_pull", 96)
    assert whole.remote is not None and whole.remote["remote_block_ids"] == [
        list(range(1, 7)),
        list(range(11, 17)),
    ]


@pytest.mark.parametrize(
    ("answer", "prompt", "reason"),
    [
        (_claimed(), _prompt([9] * 120), "prefix_mismatch"),
        (_claimed(threshold=64), _prompt(_HELD[:40] + [9] * 80), "below_threshold"),
        (_claimed(whole_only=True), _prompt(_HELD[:50] + [9] * 60), "whole_only"),
        (_claimed(), None, "no_prompt"),
        (dataclasses.replace(_claimed(), check=None), _prompt(_HELD), "unverifiable"),
    ],
    ids=["mismatch", "threshold", "whole-only", "no-prompt", "nothing-to-verify-against"],
)
def test_a_prompt_that_does_not_verify_releases_ds_blocks(
    answer: LookupAnswer, prompt: tuple[int, bytes] | None, reason: str
) -> None:
    """The daemon claimed them for this turn: P is handed them with nothing to pull."""
    reuse = verified_reuse(answer, prompt)
    assert (reuse.decision, reuse.reason) == ("RECOMPUTE", reason)
    assert reuse.remote == {**_WHOLE, "remote_num_tokens": 0}


def test_an_answer_that_is_no_pull_is_taken_as_the_daemon_gave_it() -> None:
    release = {**D_PARAMS, "remote_num_tokens": 0}
    reuse = verified_reuse(LookupAnswer(False, "already_claimed", {}, release, 0), _prompt(_HELD))
    assert (reuse.decision, reuse.reason, reuse.remote) == ("RECOMPUTE", "already_claimed", release)


def test_prefill_and_decode_bodies() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 99,
        "max_completion_tokens": 99,
        "min_tokens": 5,
        "conversation_id": "c",
        "session_id": "s",
        "kv_transfer_params": {"client": "junk"},
    }
    p = prefill_body(body, {"do_remote_decode": True})
    assert p["stream"] is False and p["max_tokens"] == 1 == p["max_completion_tokens"]
    assert "stream_options" not in p and "min_tokens" not in p and "conversation_id" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True} and p["session_id"] == "s"
    d = decode_body(body, {"do_remote_prefill": True}, [1, 2])
    assert d["stream"] is True and d["max_tokens"] == 99 and "conversation_id" not in d
    assert d["kv_transfer_params"] == {"do_remote_prefill": True, "prompt_token_ids": [1, 2]}
    assert "kv_transfer_params" not in decode_body(body, None, None)
    # No P params: no token ids either (params without a prefill's would pin D's blocks for good)
    assert "kv_transfer_params" not in decode_body(body, None, [1, 2])
    assert body["conversation_id"] == "c"  # the client's body is not changed


# -- relay --------------------------------------------------------------------------------------


def _sse(*objs: object) -> bytes:
    return b"".join(
        b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs
    )


def test_streams_pass_unchanged_except_the_params() -> None:
    s = SseScrubber()
    plain = _sse({"choices": [{"delta": {"content": "a"}}]})
    assert s.feed(plain) is plain
    last = _sse({"choices": [], "kv_transfer_params": D_PARAMS}, b"[DONE]")
    out = s.feed(last)
    assert b"kv_transfer_params" not in out and out.endswith(b"data: [DONE]\n\n")
    assert json.loads(out.split(b"\n\n")[0][6:]) == {"choices": []}


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_any_chunking_gives_the_same_stream(cuts: list[int]) -> None:
    stream = _sse(
        {"choices": [{"delta": {"content": "héllo"}}]},
        {"choices": [], "kv_transfer_params": D_PARAMS},
        b"[DONE]",
    )
    s, out, pos = SseScrubber(), b"", 0
    for c in cuts:
        out += s.feed(stream[pos : pos + c])
        pos += c
    out += s.feed(stream[pos:]) + s.flush()
    events = [e[len(b"data: ") :] for e in out.split(b"\n\n") if e]
    assert events[0] == stream.split(b"\n\n")[0][len(b"data: ") :]  # untouched, byte for byte
    assert json.loads(events[1]) == {"choices": []} and events[2] == b"[DONE]" and len(events) == 3


def test_an_error_event_is_noticed_and_relayed_as_it_came() -> None:
    s = SseScrubber()
    said = _sse({"choices": [{"delta": {"content": 'the "error" was {"error": 1}'}}]})
    assert s.feed(said) is said and s.error is None  # quotes inside a string are escaped
    error = {"error": {"message": "KV load failed", "type": "InternalServerError", "code": 503}}
    end = _sse(error, b"[DONE]")
    assert s.feed(end[:20]) == b"" and s.error is None
    assert s.feed(end[20:]) == end and s.error == 503
    coded = SseScrubber()
    coded.feed(_sse({"error": {"message": "no code"}}))
    assert coded.error == 500


def test_json_answers_get_null_params() -> None:
    raw = json.dumps({"id": "x", "kv_transfer_params": D_PARAMS}).encode()
    assert json.loads(scrub_json(raw)) == {"id": "x", "kv_transfer_params": None}
    untouched = b'{"id": "x", "kv_transfer_params": null}'
    assert scrub_json(untouched) is untouched
    assert scrub_json(b"not json kv_transfer_params") == b"not json kv_transfer_params"


# -- tokenize requests ----------------------------------------------------------------------------


def test_tokenize_renders_what_the_engine_would() -> None:
    chat = {"model": "m", "messages": [], "tools": [{}], "chat_template_kwargs": {"x": 1}, "max_tokens": 3}
    assert tokenize_request("/v1/chat/completions", chat) == {
        "model": "m",
        "messages": [],
        "tools": [{}],
        "chat_template_kwargs": {"x": 1},
    }
    assert tokenize_request("/v1/completions", {"prompt": "hi"}) == {"prompt": "hi"}
    assert tokenize_request("/v1/completions", {"prompt": [1, 2]}) == [1, 2]
    assert tokenize_request("/v1/completions", {"prompt": [[1, 2]]}) == [1, 2]
    assert tokenize_request("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert tokenize_request("/v1/completions", {"prompt": [1, -2]}) is None
    assert tokenize_request("/v1/completions", {"prompt": [1, 2**32]}) is None
    assert tokens_of(b'{"count": 2, "tokens": [1, 2]}') == [1, 2]
    for bad in (
        b'{"tokens": []}',
        b'{"tokens": ["a"]}',
        b'{"tokens": [-1]}',
        b"[1]",
        b"nope",
        b'{"tokens": [1.5]}',
    ):
        assert tokens_of(bad) is None, bad


# -- what the router can verify --------------------------------------------------------------------


def test_only_text_content_is_verifiable() -> None:
    text = {"role": "user", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert text_only({"messages": [text, parts, {"role": "assistant", "content": None}]})
    assert text_only({"prompt": "hi"}) and text_only({"prompt": [1, 2, 3]})
    for part in ({"type": "image_url", "image_url": {"url": "x"}}, {"type": "input_audio"}, "raw", {}):
        assert not text_only({"messages": [text, {"role": "user", "content": [part]}]}), part


def test_a_completion_needs_a_prompt_or_its_embeddings() -> None:
    from router.http_api import input_problem

    completions = "/v1/completions"
    assert input_problem(completions, {"prompt_embeds": "AAAA"}) is None  # vLLM takes either
    assert input_problem(completions, {"prompt": "hi"}) is None
    assert input_problem(completions, {"prompt": ""}) == "'prompt' (or 'prompt_embeds') is required."


def test_flags_are_read_as_pydantic_reads_them_in_lax_mode() -> None:
    from kvferry.decoding import lax_bool
    from router.http_api import input_problem

    for value in (True, 1, 1.0, "1", "true", "True", "TRUE", "t", "y", "yes", "on"):
        assert lax_bool(value) is True, value
    for value in (False, 0, 0.0, "0", "false", "False", "f", "n", "no", "off", "OFF"):
        assert lax_bool(value) is False, value
    for value in (2, -1, 0.5, "", " true", "maybe", [], {}, None):
        with pytest.raises(ValueError):
            lax_bool(value)
    body: dict[str, object] = {"prompt": "p", "stream": "yes", "echo": 0, "return_token_ids": None}
    assert input_problem("/v1/completions", body) is None
    assert body == {"prompt": "p", "stream": True, "echo": False, "return_token_ids": None}
    assert input_problem("/v1/completions", {"prompt": "p", "echo": "sure"}) == "'echo' must be a boolean."


def test_a_prompt_is_reproducible_when_tokenize_renders_what_the_engines_do() -> None:
    """/tokenize takes messages, tools, chat_template(_kwargs), add_generation_prompt,
    continue_final_message, add_special_tokens: nothing else may shape the prompt."""
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "ls"}}
    for body in (
        hi,
        {**hi, "tools": [tool]},
        {**hi, "tools": [tool], "tool_choice": "auto"},
        {**hi, "tool_choice": "required"},  # (no tools: vLLM renders no tool choice)
        {**hi, "chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": True},
    ):
        assert reproducible(body), body
    for body in (
        {**hi, "tools": [tool], "tool_choice": "none"},
        {**hi, "tools": [tool], "tool_choice": "required"},
        {**hi, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "ls"}}},
        {**hi, "response_format": {"type": "json_object"}},
        {**hi, "documents": []},
        {**hi, "reasoning_effort": "low"},
        {"prompt": "hi", "truncate_prompt_tokens": 5},
    ):
        assert not reproducible(body), body


# -- settings --------------------------------------------------------------------------------------


def _parse(*argv: str) -> Settings:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_flags_make_settings() -> None:
    s = _parse("--daemon", "a:1,b:2", "--prefill", "http://p/", "--decode", "http://d", "--reuse", "false")
    assert s.daemon.addresses == ("a:1", "b:2") and s.nodes.prefill_urls == ("http://p",)
    assert s.reuse.enabled is False and s.daemon.lookup_deadline_s == 0.05
    assert s.upstream.forward_prompt_token_ids is False  # (the engines render the prompt)
    assert _parse("--daemon", "a:1", "--forward-prompt-token-ids", "true").upstream.forward_prompt_token_ids
    with pytest.raises(ValueError, match="daemon"):
        _parse()
    with pytest.raises(ValueError, match="http"):
        _parse("--prefill", "p:1", "--decode", "http://d")
    good = _parse("--daemon", "a:1")
    with pytest.raises(ValueError, match="max_releases_in_flight"):
        dataclasses.replace(
            good, upstream=dataclasses.replace(good.upstream, max_releases_in_flight=0)
        ).validate()


def test_a_lookup_wait_past_an_answers_validity_is_refused() -> None:
    """An answer is used at most ANSWER_VALID_S after its lookup left (its claim may be
    spent by a new owner after that): a longer wait was silently cut short."""
    from kvferry.limits import ANSWER_VALID_S

    assert _parse("--daemon", "a:1", "--lookup-max-wait", str(ANSWER_VALID_S - 0.5))
    for flag in ("--lookup-max-wait", "--lookup-deadline"):
        with pytest.raises(ValueError, match="the longest an answer is valid"):
            _parse("--daemon", "a:1", flag, str(ANSWER_VALID_S))

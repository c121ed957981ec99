"""Pure decisions of the router: identity, node choice, what P and D get, retries, relay."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.ids import MAX_ID_BYTES
from kvferry.releases import release_body, released, tick_body
from kvferry.turnheaders import conversation_of, safe_id
from router.choice import (
    Node,
    alike,
    choose_decode,
    choose_prefill,
    fresh_retry_node,
    serving,
    worth_scoring,
)
from router.decisions import (
    Breaker,
    Failure,
    FailureKind,
    LookupAnswer,
    Retry,
    decode_body,
    prefill_body,
    prefill_kv_params,
    reproducible,
    retry_after,
    retry_decode_elsewhere,
    reuse_of,
    single_sequence,
    spends_retry,
    text_only,
)
from router.identity import identify, tenant_of
from router.nodes import DirectRoutes, base_model_of, static_nodes
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

# -- identity -------------------------------------------------------------------------------


def test_a_turn_uses_the_nodes_of_the_model_it_names() -> None:
    a, b = Node("a", "both", "http://a", model="m-a"), Node("b", "both", "http://b", model="m-b")
    assert serving([a, b], "m-b") == [b]
    unknown = Node("u", "both", "http://u")  # its /v1/models not read yet: still a candidate
    assert serving([a, b, unknown], "m-b") == [b, unknown]
    # An adapter's name, no model, or one no node reports: every node (the engine judges).
    assert serving([a, b], "my-lora") == serving([a, b], None) == serving([a, b], "") == [a, b]


def test_only_one_answer_to_one_prompt_goes_through_p_and_d() -> None:
    assert single_sequence({"messages": [{"role": "user", "content": "hi"}]})
    assert single_sequence({"prompt": "one", "n": 1, "best_of": None})
    assert single_sequence({"prompt": [1, 2, 3]})  # token ids: one prompt
    assert single_sequence({"prompt": ["one"]}) and single_sequence({"prompt": [[1, 2]]})
    assert not single_sequence({"messages": [], "n": 2})
    assert single_sequence({"prompt": "one", "best_of": 3})  # gone from vLLM's API, ignored there
    assert not single_sequence({"prompt": ["one", "two"]})
    assert not single_sequence({"prompt": [[1, 2], [3]]})
    assert not single_sequence({"prompt": [1, "two"]})  # not ids: the engine judges it
    assert not single_sequence({"prompt_embeds": "AAAA"})  # (vLLM's: base64 tensors, one or more)
    assert not single_sequence({"prompt": "text", "prompt_embeds": ["AAAA"]})


def test_conversation_identity_sources_in_order() -> None:
    assert conversation_of({"X-Conversation-Id": "h"}, {"conversation_id": "b"}) == "h"
    assert conversation_of({"X-Session-ID": "s"}, {"conversation_id": "b"}) == "b"
    assert conversation_of({"X-Session-ID": "s"}, {"session_id": "v"}) == "s"
    assert conversation_of({}, {"session_id": "v"}) == "v"
    assert conversation_of({}, {"conversation_id": 42}) == "42"
    assert conversation_of({}, {"conversation_id": True, "session_id": "  "}) == ""
    assert conversation_of({}, {}) == ""


def test_ids_the_daemon_would_refuse_become_stable_digests() -> None:
    long = "x" * (MAX_ID_BYTES + 1)
    assert safe_id(long, "conv") == safe_id(long, "conv") != long
    assert len(safe_id(long, "conv")) < MAX_ID_BYTES
    assert safe_id("a\nb", "conv").startswith("conv-")
    assert safe_id("ok-id", "conv") == "ok-id"


def test_non_utf8_header_bytes_make_ids_not_errors() -> None:
    """aiohttp decodes a header's non-UTF-8 bytes to surrogates (surrogateescape): they are
    digested like control characters, and an API key made of them still hashes."""
    raw = b"caf\xe9".decode("utf-8", "surrogateescape")
    who = identify({"X-Conversation-Id": raw, "X-Kvferry-Tenant": raw}, {}, "X-Kvferry-Tenant")
    assert who.conversation_id.startswith("conv-") and who.tenant.startswith("tenant-")
    assert who.conversation_id == identify({"X-Conversation-Id": raw}, {}, "").conversation_id
    assert who.conversation_id.encode() and who.tenant.encode()  # what protobuf will need
    keyed = identify({"X-Conversation-Id": "c", "Authorization": "Bearer k" + raw}, {}, "X-Kvferry-Tenant")
    assert keyed.tenant.startswith("key-")


def test_tenant_is_a_hash_of_the_api_key_never_the_key() -> None:
    alice = tenant_of({"Authorization": "Bearer sk-alice"}, "X-Kvferry-Tenant")
    assert alice.startswith("key-") and "sk-alice" not in alice
    assert alice == tenant_of({"Authorization": "bearer  sk-alice "}, "X-Kvferry-Tenant")
    assert alice != tenant_of({"Authorization": "Bearer sk-bob"}, "X-Kvferry-Tenant")
    # The key wins over a tenant header: a client cannot name someone else's tenant.
    assert (
        tenant_of({"Authorization": "Bearer sk-alice", "X-Kvferry-Tenant": "bob"}, "X-Kvferry-Tenant")
        == alice
    )
    assert tenant_of({"X-Kvferry-Tenant": "acme"}, "X-Kvferry-Tenant") == "acme"
    # Nor can a header name a key's tenant (its hash shows in lease listings and logs).
    posing = tenant_of({"X-Kvferry-Tenant": alice}, "X-Kvferry-Tenant")
    assert posing != alice and posing.startswith("tenant-")
    assert tenant_of({"X-Kvferry-Tenant": "acme"}, "") == ""
    assert tenant_of({"Authorization": "Basic abc"}, "") == ""


def test_no_conversation_means_no_identity_at_all() -> None:
    ident = identify({"Authorization": "Bearer k"}, {}, "X-Kvferry-Tenant")
    assert (ident.tenant, ident.conversation_id) == ("", "")


# -- node choice ----------------------------------------------------------------------------


def _nodes() -> list[Node]:
    return [
        Node("p1", "prefill", "http://p1", indexed_blocks=10),
        Node("p2", "prefill", "http://p2", indexed_blocks=10),
        Node("b1", "both", "http://b1"),
        Node("d1", "decode", "http://d1"),
        Node("d2", "decode", "http://d2"),
    ]


def test_decode_is_the_least_busy_and_ties_rotate() -> None:
    nodes = _nodes()
    assert choose_decode(nodes, {"d1": 2, "d2": 1, "b1": 3}).engine_id == "d2"  # type: ignore[union-attr]
    picks = {choose_decode(nodes, {"b1": 5}, t).engine_id for t in range(4)}  # type: ignore[union-attr]
    assert picks == {"d1", "d2"}
    assert choose_decode([Node("p", "prefill", "u")], {}) is None
    # A D of P's block size first, however busy (P's KV, and the next turn's digests, are in
    # blocks of that size); another only when there is none.
    mixed = [*nodes, Node("d32", "decode", "http://d32", block_size=32)]
    assert choose_decode(mixed, {"d1": 9, "d2": 9, "b1": 9}, block_size=32).engine_id == "d32"  # type: ignore[union-attr]
    assert choose_decode(mixed, {"d1": 9, "d2": 9, "b1": 9}, block_size=16).engine_id != "d32"  # type: ignore[union-attr]
    assert choose_decode(nodes, {}, block_size=64) is not None


def test_prefill_prefers_the_cached_prefix_unless_much_busier() -> None:
    nodes = _nodes()
    assert choose_prefill(nodes, {"p1": 1, "b1": 1}).engine_id == "p2"  # type: ignore[union-attr]
    cached = {"p1": 50, "p2": 3}
    assert choose_prefill(nodes, {"p1": 3}, cached).engine_id == "p1"  # type: ignore[union-attr]
    assert choose_prefill(nodes, {"p1": 9}, cached, load_slack=4).engine_id == "p2"  # type: ignore[union-attr]
    assert choose_prefill(nodes, {}, exclude={"p1", "p2", "b1"}) is None
    assert choose_prefill(nodes, {}, cached, exclude={"p1"}).engine_id == "p2"  # type: ignore[union-attr]


def test_a_p_is_only_traded_for_one_of_the_same_model_and_block_size() -> None:
    """The prompt's token ids came from one P's tokenizer, its digests (and a pull's params,
    D's blocks) are in its block size: a P chosen after that must take the same."""
    tokenized = Node("p1", "prefill", "http://p1", model="m", block_size=16)
    nodes = [
        tokenized,
        Node("p2", "prefill", "http://p2", model="m", block_size=16),
        Node("p3", "prefill", "http://p3", model="m", block_size=64),
        Node("p4", "prefill", "http://p4", model="other", block_size=16),
        Node("p5", "prefill", "http://p5", model="", block_size=16),  # model not known yet
        Node("d1", "decode", "http://d1", model="m", block_size=16),
    ]
    assert [n.engine_id for n in alike(nodes, tokenized)] == ["p1", "p2"]
    cached = {"p3": 500, "p4": 500, "p5": 500, "p2": 1}
    assert choose_prefill(alike(nodes, tokenized), {}, cached).engine_id == "p2"  # type: ignore[union-attr]


def test_a_tokenize_answer_nested_too_deep_is_no_answer() -> None:
    assert tokens_of(b'{"tokens": [1, 2], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}") is None


def test_a_fresh_retry_leaves_an_unreachable_p_for_any_other() -> None:
    """Without D's params any P of the model will do: an unreachable P is left for one of
    another block size rather than tried again (which answered the client 502)."""
    p1 = Node("p1", "prefill", "http://p1", model="m", block_size=16)
    p2 = Node("p2", "prefill", "http://p2", model="m", block_size=32)
    nodes = [p1, p2, Node("d1", "decode", "http://d1", model="m", block_size=16)]
    assert fresh_retry_node(p1, nodes, {"p1"}, {}, unreachable=True) is p2
    assert fresh_retry_node(p1, nodes, {"p1"}, {}, unreachable=False) is p1  # it answered: again
    assert fresh_retry_node(p1, [p1], {"p1"}, {}, unreachable=True) is p1  # no other


def test_scoring_only_when_it_can_change_the_choice() -> None:
    nodes = _nodes()
    assert worth_scoring(nodes)
    assert not worth_scoring([n for n in nodes if n.engine_id != "p2"], exclude={"b1"})
    assert not worth_scoring([Node("p1", "prefill", "u"), Node("p2", "prefill", "v")])


def test_static_nodes_and_the_base_model_of_a_models_answer() -> None:
    nodes = static_nodes(["http://a", "http://b"], ["http://b", "http://c"], "m", 32)
    assert [(n.engine_id, n.role) for n in nodes] == [
        ("http://a", "prefill"),
        ("http://b", "both"),
        ("http://c", "decode"),
    ]
    assert all(n.block_size == 32 and n.model == "m" for n in nodes)
    answer = {"data": [{"id": "lora-1", "parent": "base"}, {"id": "base", "parent": None}]}
    assert base_model_of(answer) == "base"
    assert base_model_of({"data": "nope"}) == "" == base_model_of([])


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


# -- retries ----------------------------------------------------------------------------------


def test_a_failed_pull_is_retried_once_without_params() -> None:
    five = Failure(FailureKind.STATUS, 500)
    assert retry_after(five, sent_remote=True, attempt=0, other_node_available=False) is Retry.FRESH
    assert retry_after(Failure(FailureKind.STATUS, 400), True, 0, False) is Retry.FRESH
    assert retry_after(five, True, 1, True) is None


def test_without_params_only_an_unreachable_p_is_retried_elsewhere() -> None:
    connect = Failure(FailureKind.CONNECT)
    assert retry_after(connect, False, 0, True) is Retry.OTHER_NODE
    assert retry_after(connect, False, 0, False) is None
    assert retry_after(Failure(FailureKind.STATUS, 500), False, 0, True) is None
    assert retry_after(Failure(FailureKind.STATUS, 404), False, 0, True) is None
    assert retry_after(Failure(FailureKind.TIMEOUT), True, 0, True) is None


def test_an_unreachable_p_hands_the_params_to_another_p() -> None:
    """P never saw the daemon's params: another P pulls the same blocks (not recompute)."""
    connect = Failure(FailureKind.CONNECT)
    assert retry_after(connect, sent_remote=True, attempt=0, other_node_available=True) is Retry.OTHER_NODE
    assert retry_after(connect, sent_remote=True, attempt=0, other_node_available=False) is Retry.FRESH
    assert not spends_retry(Retry.OTHER_NODE, sent_remote=True)  # a failing pull there still gets FRESH
    assert spends_retry(Retry.OTHER_NODE, sent_remote=False) and spends_retry(Retry.FRESH, sent_remote=True)


def test_decode_goes_elsewhere_only_when_d_never_saw_the_request() -> None:
    assert retry_decode_elsewhere(Failure(FailureKind.CONNECT), True)
    assert not retry_decode_elsewhere(Failure(FailureKind.CONNECT), False)
    assert not retry_decode_elsewhere(Failure(FailureKind.PROTOCOL), True)
    assert not retry_decode_elsewhere(Failure(FailureKind.TIMEOUT), True)
    nodes = _nodes()
    assert choose_decode(nodes, {}, exclude={"d1", "d2"}).engine_id == "b1"  # type: ignore[union-attr]
    assert choose_decode(nodes, {}, exclude={"d1", "d2", "b1"}) is None


def test_client_errors_are_4xx_statuses_only() -> None:
    assert Failure(FailureKind.STATUS, 404).client_error
    assert not Failure(FailureKind.STATUS, 503).client_error
    assert not Failure(FailureKind.CONNECT).client_error


def test_breaker_pauses_lookups_doubling_and_closes_on_success() -> None:
    b = Breaker(0.1, 1.0)
    assert b.allows(0.0)
    b.record(False, 10.0)
    assert not b.allows(10.05) and b.allows(10.1)
    b.record(False, 10.1)
    assert not b.allows(10.25) and b.allows(10.3)
    for _ in range(10):
        b.record(False, 20.0)
    assert b.open_until == pytest.approx(21.0)
    b.record(True, 21.0)
    assert b.allows(21.0) and b.failures == 0


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


def test_an_unreachable_engine_url_is_avoided_for_a_while() -> None:
    now = [100.0]
    routes = DirectRoutes(retry_after_s=60.0, clock=lambda: now[0])
    p = Node(engine_id="p-1", role="prefill", url="http://10.0.0.1:8100", engine_url="http://10.0.0.1:8000")
    plain = Node(engine_id="p-2", role="prefill", url="http://10.0.0.2:8100")
    assert routes.url(p) == p.engine_url and routes.url(plain) == plain.url
    assert not routes.unreachable(plain, plain.url)  # nothing to fall back from
    assert routes.unreachable(p, p.engine_url)
    assert routes.url(p) == p.url
    assert not routes.unreachable(p, p.url)  # the sidecar itself failed: a real failure
    now[0] += 61
    assert routes.url(p) == p.engine_url  # tried again later


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


async def test_no_score_is_asked_while_the_breaker_holds_lookups_back() -> None:
    """A failing daemon: a scored turn does not wait for Score to fail as well."""
    import time

    from router.daemon_client import DaemonClient
    from router.settings import DaemonSettings

    control = DaemonClient(["127.0.0.1:1"], DaemonSettings(addresses=("127.0.0.1:1",)))
    asked: list[object] = []
    control._replica.nodes.Score = lambda *a, **k: asked.append(a)  # type: ignore[method-assign]
    control.breaker.record(False, time.monotonic())
    try:
        assert await control.score([1, 2]) == {} and asked == []
    finally:
        await control.close()


async def test_lookups_leave_a_replica_that_keeps_answering_late() -> None:
    """A replica that keeps its connection but answers no lookup in time (hung, or
    overloaded): after three in a row the next lookups go to another replica. Only one that
    could not be reached was left before; lookups skipped reuse while a healthy one idled.
    Lookups out together (one slow etcd round) are late together: they count once."""
    import asyncio
    import time

    import grpc

    from kvferry.leaseclient import LeaseOpError
    from router.daemon_client import LATE_FAILOVER, DaemonClient
    from router.settings import DaemonSettings

    addresses = ("127.0.0.1:1", "127.0.0.1:2")
    control = DaemonClient(list(addresses), DaemonSettings(addresses=addresses))

    async def late(req: object, message: Any, *args: object) -> object:
        message.close()  # (the prompt it would have sent)
        await asyncio.sleep(0.01)
        raise LeaseOpError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")

    async def lookup() -> Any:
        prompt: asyncio.Future[tuple[list[int], bytes] | None] = asyncio.get_running_loop().create_future()
        prompt.set_result(None)
        return await control.lookup_early("", "c", prompt)

    hung = control._replica
    hung.stream.lookup_with_prompt = late  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(lookup() for _ in range(LATE_FAILOVER)))
        assert control._replica is hung and hung.late == 1
        for i in range(LATE_FAILOVER - 1):
            assert control._replica is hung, i
            control.breaker.open_until = 0.0  # (the breaker's pause over)
            reuse = await lookup()
            assert (reuse.decision, reuse.reason) == ("SKIPPED", "daemon_timeout")
        assert control._replica is not hung and control._replica.address == addresses[1]
        assert time.monotonic() < control.breaker.open_until  # (the breaker counted them)
    finally:
        await control.close()


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

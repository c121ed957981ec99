"""Turns of one conversation through the router: reuse, and answers that never change.

Everything is real: etcd, the daemon, emulated P and D with their sidecars, the
router. The no-reuse answer comes from a single engine computing the whole prompt.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvferry.v1 import leases_pb2, nodes_pb2
from tests.router.conftest import MakeStack, Reference
from tests.router.helpers import (
    CHAT,
    COMPLETIONS,
    ask,
    first_turn,
    next_turn,
    pulled_tokens,
    tokenize,
    unheld_reads,
)


async def test_a_turn_after_a_finished_turn_pulls_and_answers_the_same(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """Streamed turns are captured when D's stream carries its params (vLLM PR 40186; 0.32's
    streams carry none), and the client never sees them; a JSON turn after them pulls too."""
    stack = await make_stack(d_config={"stream_kv_transfer_params": True})  # (vLLM PR 40186)
    router = await stack.router()
    [p] = stack.prefills
    messages = first_turn("ferries")
    body: dict[str, Any] = {"model": "kvferry/emulated-model", "messages": messages, "max_tokens": 40}

    one = await ask(http, router.url, {**body, "conversation_id": "conv-1", "stream": True})
    assert one.status == 200
    assert one.decision == "RECOMPUTE" and one.reason == "no_lease"
    assert one.events[-1] == "[DONE]"
    assert all("kv_transfer_params" not in e for e in one.events if isinstance(e, dict))
    assert one.text == await reference(CHAT, body)
    await stack.registrations_idle()

    second = {**body, "messages": next_turn(messages, one.text)}
    before = pulled_tokens(p)
    two = await ask(http, router.url, {**second, "stream": True}, {"X-Session-ID": "conv-1"})
    assert two.status == 200
    # D's sequence ends in a partial block no digest covers: the pull stops at the last full block.
    assert two.decision == "PULL" and two.reason in ("pull", "partial_pull"), dict(two.headers)
    assert two.reused >= len(one.text) and two.reused % 16 == 0
    assert pulled_tokens(p) - before == two.reused  # P really pulled what the daemon handed out
    assert two.text == await reference(CHAT, second)
    assert router.metrics.value("kvferry_router_lookups_total", decision="PULL", reason=two.reason) == 1
    assert router.metrics.value("kvferry_router_reused_tokens_total") == two.reused
    # Turn 2 hashed only the blocks after turn 1's prompt (the digest cache): the
    # answer above is the reference, so the digests it was verified with were right.
    digested = {
        how: router.metrics.value("kvferry_router_digest_blocks_total", how=how)
        for how in ("reused", "hashed")
    }
    assert digested["reused"] > 0 and digested["hashed"] < 2 * digested["reused"]

    # Non-streaming, conversation named by the header: the JSON answer as vLLM gives it.
    await stack.registrations_idle()
    third = {**body, "messages": next_turn(second["messages"], two.text, "And then? ")}
    three = await ask(http, router.url, third, {"X-Conversation-Id": "conv-1"})
    assert three.status == 200 and three.decision == "PULL"
    assert three.body["object"] == "chat.completion"
    assert three.body["kv_transfer_params"] is None
    assert three.text == await reference(CHAT, third)


UNREACHABLE = "http://127.0.0.1:9"  # (discard port: nothing listens there)


@pytest.mark.parametrize("advertised", ["", "none", UNREACHABLE])
async def test_tokenize_and_prefill_skip_the_p_sidecar_when_it_advertises_the_engine(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference, advertised: str
) -> None:
    """Through P's tap only when it advertised no engine URL, or one this router cannot
    reach (then the router falls back to the tap, and stays there)."""
    stack = await make_stack(p_engine_url=advertised)
    router = await stack.router(upstream__health_interval_s=3600)  # (its /health probes pass the tap)
    [p] = stack.prefills
    listed = await stack.client.nodes.List(nodes_pb2.ListNodesRequest())
    engine_urls = {n.engine_id: n.engine_url for n in listed.nodes}
    expected_url = {"": p.http_url, "none": "", UNREACHABLE: UNREACHABLE}[advertised]
    assert engine_urls[stack.sidecar(p).settings.node_id] == expected_url
    messages = first_turn("tolls")
    body: dict[str, Any] = {"model": "kvferry/emulated-model", "messages": messages, "max_tokens": 24}
    one = await ask(http, router.url, {**body, "conversation_id": "conv-t"})
    await stack.registrations_idle()
    second = {**body, "messages": next_turn(messages, one.text)}
    two = await ask(http, router.url, {**second, "conversation_id": "conv-t"})
    assert two.decision == "PULL" and two.text == await reference(CHAT, second)
    proxied = stack.sidecar(p).metrics.registry.get_sample_value(
        "kvferry_sidecar_proxied_requests_total", {"tapped": "no"}
    )
    # Two turns, each a /tokenize and a prefill.
    assert (proxied or 0.0) == (0.0 if advertised == "" else 4.0)
    for role in ("tokenize", "prefill"):  # the fallback is no error
        assert router.metrics.value("kvferry_router_upstream_errors_total", role=role, kind="connect") == 0


async def test_edited_history_pulls_only_what_matches_and_never_answers_wrong(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("harbours", size=8)
    body: dict[str, Any] = {"messages": messages, "max_tokens": 60, "ignore_eos": True}
    headers = {"X-Conversation-Id": "edited", "Authorization": "Bearer sk-alice"}

    one = await ask(http, router.url, body, headers)
    assert one.status == 200
    await stack.registrations_idle()
    # The client drops the second half of the answer (as clients drop reasoning text).
    cut = next_turn(messages, one.text[: len(one.text) // 2])
    two = await ask(http, router.url, {**body, "messages": cut}, headers)
    assert two.status == 200
    assert two.decision == "PULL" and two.reason == "partial_pull"
    first_prompt = len(await tokenize(http, stack.prefills[0], messages))
    assert 0 < two.reused <= first_prompt + len(one.text) // 2
    assert two.text == await reference(CHAT, {**body, "messages": cut})

    # Now the client rewrites the system prompt: nothing of D's sequence matches.
    await stack.registrations_idle()
    rewritten = [{"role": "system", "content": "Be brief. " * 30}, *next_turn(cut, two.text)[1:]]
    three = await ask(http, router.url, {**body, "messages": rewritten}, headers)
    assert three.status == 200
    assert three.decision == "RECOMPUTE" and three.reason == "prefix_mismatch"
    assert three.text == await reference(CHAT, {**body, "messages": rewritten})

    # Another API key is another tenant: the conversation id alone reaches nothing.
    await stack.registrations_idle()
    other = await ask(
        http,
        router.url,
        {**body, "messages": next_turn(rewritten, three.text)},
        {**headers, "Authorization": "Bearer sk-mallory"},
    )
    assert other.status == 200 and other.decision == "RECOMPUTE" and other.reason == "no_lease"
    assert unheld_reads(stack.decodes) == 0


async def test_completions_with_a_session_id_pull_too(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    router = await stack.router()
    prompt = "Once upon a time a ferry crossed the bay. " * 12
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 30, "session_id": "story"}
    # (turn one is not streamed: vLLM 0.32's streams carry no params, so D's answer to a
    # streamed turn registers nothing to pull)
    one = await ask(http, router.url, body, path=COMPLETIONS)
    assert one.status == 200 and one.body["object"] == "text_completion"
    assert one.text == await reference(COMPLETIONS, body)
    await stack.registrations_idle()
    body2 = {**body, "prompt": prompt + one.text + " The end?"}
    two = await ask(http, router.url, {**body2, "stream": True}, path=COMPLETIONS)
    assert two.status == 200 and two.decision == "PULL", dict(two.headers)
    assert two.events[-1] == "[DONE]"
    assert two.text == await reference(COMPLETIONS, body2)


async def test_a_clients_request_id_names_its_answers_and_every_turn_still_pulls(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """As from vLLM, the answer's id is made of the client's X-Request-Id, echoed back. An
    agent that sends the same one every turn still reuses: the daemon and D's sidecar know
    each turn by the router's own id (the same id twice would look like the lookup's own
    turn, and be left alone)."""
    stack = await make_stack()
    router = await stack.router()
    [p] = stack.prefills
    messages = first_turn("request ids")
    body: dict[str, Any] = {"messages": messages, "max_tokens": 30, "conversation_id": "rid"}
    mine = {"X-Request-Id": "agent-42"}
    # (turn one is not streamed: vLLM 0.32's streams carry no params to retain)
    one = await ask(http, router.url, body, mine)
    assert one.status == 200 and one.headers["X-Request-Id"] == "agent-42"
    assert one.body["id"] == "chatcmpl-agent-42"
    await stack.registrations_idle()
    get = leases_pb2.GetLeaseRequest(conversation_id="rid")
    assert (await stack.client.leases.Get(get)).request_id.startswith("kvf-")  # the turn's own id
    second = {**body, "messages": next_turn(messages, one.text)}
    before = pulled_tokens(p)
    two = await ask(http, router.url, {**second, "stream": True}, mine)
    assert two.status == 200 and two.decision == "PULL", dict(two.headers)
    assert {e["id"] for e in two.events if isinstance(e, dict)} == {"chatcmpl-agent-42"}
    assert two.headers["X-Request-Id"] == "agent-42"
    assert pulled_tokens(p) - before == two.reused > 0
    assert two.text == await reference(CHAT, {k: v for k, v in second.items() if k != "conversation_id"})
    # With none in the header, the body's request_id is the one, as vLLM takes it.
    in_body = await ask(http, router.url, {"messages": messages, "max_tokens": 2, "request_id": "b-9"})
    assert in_body.body["id"] == "chatcmpl-b-9" and in_body.headers["X-Request-Id"] == "b-9"
    # Without one (or with one no header should carry on), the router's id is the answer's.
    for odd_id in ("é" * 3, "x" * 257, "a\tb"):
        odd = await ask(http, router.url, {"messages": messages, "max_tokens": 2}, {"X-Request-Id": odd_id})
        assert odd.status == 200 and odd.headers["X-Request-Id"].startswith("kvf-"), odd_id
        assert odd.body["id"] == "chatcmpl-" + odd.headers["X-Request-Id"]


async def test_without_a_conversation_id_the_router_serves_plain_pd(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    router = await stack.router()
    body: dict[str, Any] = {"messages": first_turn("tides"), "max_tokens": 20}
    res = await ask(http, router.url, {**body, "stream": True})
    assert res.status == 200 and res.decision == ""
    assert res.text == await reference(CHAT, body)
    assert router.metrics.value("kvferry_router_lookups_total", decision="PULL", reason="pull") == 0
    [d] = stack.decodes
    assert pulled_tokens(d) > 0  # D took P's KV: real P/D


async def test_reuse_off_serves_every_turn_without_lookups(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    router = await stack.router(reuse__enabled=False)
    messages = first_turn("lighthouses")
    one = await ask(http, router.url, {"messages": messages, "max_tokens": 20, "conversation_id": "x"})
    await stack.registrations_idle()
    body = {"messages": next_turn(messages, one.text), "max_tokens": 20}
    two = await ask(http, router.url, {**body, "conversation_id": "x"})
    assert (one.decision, two.decision) == ("SKIPPED", "SKIPPED") and two.reason == "reuse_off"
    assert two.text == await reference(CHAT, body)
    assert pulled_tokens(stack.prefills[0]) == 0


_TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "reused"),
    [
        ({"tools": [_TOOL]}, True),  # /tokenize is given them: the turn is verified and pulls
        ({"chat_template_kwargs": {"enable_thinking": False}}, True),
        ({"chat_template_kwargs": {"reasoning_effort": "low"}}, True),  # (given to /tokenize too)
        ({"documents": [{"title": "t", "text": "tide tables"}]}, False),  # /tokenize cannot be
        ({"reasoning_effort": "low"}, False),
    ],
)
async def test_what_the_template_sees_besides_the_messages_never_changes_the_answer(
    make_stack: MakeStack,
    http: aiohttp.ClientSession,
    reference: Reference,
    fields: dict[str, Any],
    reused: bool,
) -> None:
    """The emulator's template renders tools, chat_template_kwargs, documents and a
    reasoning effort, and its /tokenize only what vLLM's takes: token ids the router got
    without documents would be another prompt's, and the answer would differ."""
    stack = await make_stack()
    router = await stack.router()
    body: dict[str, Any] = {"messages": first_turn("harbour tools"), "max_tokens": 24, **fields}
    one = await ask(http, router.url, {**body, "conversation_id": "tpl"})
    assert one.status == 200 and one.text == await reference(CHAT, body)
    await stack.registrations_idle()
    second = {**body, "messages": next_turn(body["messages"], one.text)}
    two = await ask(http, router.url, {**second, "conversation_id": "tpl"})
    assert two.status == 200 and two.text == await reference(CHAT, second)
    assert (two.decision == "PULL") is reused, (two.decision, two.reason)
    if not reused:
        assert (two.decision, two.reason) == ("SKIPPED", "prompt_not_reproducible")

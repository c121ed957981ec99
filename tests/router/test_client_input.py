"""What clients get for their own mistakes, and for requests the router serves without
P/D reuse: bad input, an engine's 4xx passed on, API keys, prompts it cannot verify,
several answers or prompts in one request."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2
from router import Router
from tests.router.conftest import MakeStack, router_settings
from tests.router.fakes import fake_engine, fakes_with_a_lease, on_fakes
from tests.router.helpers import CHAT, COMPLETIONS, ask, first_turn


async def test_bad_client_input_gets_vllms_400(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    stack = await make_stack()
    router = await stack.router()
    cases: list[tuple[str, bytes]] = [
        (CHAT, b"{not json"),
        (CHAT, b"[1, 2]"),
        (CHAT, b'{"model": "m"}'),
        (CHAT, b'{"messages": []}'),
        (CHAT, b'{"messages": ["hi"]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}'),
        ("/v1/completions", b'{"max_tokens": 3}'),
        (CHAT, b""),
        # 2 KB nested deeper than the JSON decoder recurses (RecursionError, not a DecodeError)
        (CHAT, b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}]}"),
    ]
    for path, raw in cases:
        async with http.post(router.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, raw
            err = (await r.json())["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"], raw
    assert router.metrics.value("kvferry_router_requests_total", endpoint=CHAT, status="400") == 8
    # aiohttp's own answers are JSON errors too, and a made-up path makes no metric label of its own.
    async with http.get(router.url + CHAT) as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]
        assert (await r.json())["error"]["code"] == 405
    async with http.post(router.url + "/v1/made-up", json={}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
    assert router.metrics.value("kvferry_router_requests_total", endpoint="unmatched", status="404") == 1


async def test_flags_vllm_reads_leniently_are_taken(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """vLLM's request models read booleans as pydantic does in lax mode: "true", 1, "off"..."""
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("lax")
    truth = await ask(http, router.url, {"messages": messages, "stream": True})
    assert truth.status == 200 and truth.events
    for given in ("true", "Yes", 1, "on"):
        res = await ask(
            http, router.url, {"messages": messages, "stream": given, "conversation_id": f"l{given}"}
        )
        assert res.status == 200 and res.events and res.text == truth.text, given
        assert res.headers["X-Kvferry-Reuse"] == "RECOMPUTE", given  # a conversation turn, looked up
    for given in ("false", "OFF", 0, 0.0):
        res = await ask(http, router.url, {"messages": messages, "stream": given})
        assert res.status == 200 and not res.events and res.text == truth.text, given
    # A completion's echo given as a string is read as vLLM reads it: "false" echoes nothing.
    res = await ask(http, router.url, {"prompt": "hello", "max_tokens": 3, "echo": "false"}, path=COMPLETIONS)
    plain = await ask(http, router.url, {"prompt": "hello", "max_tokens": 3}, path=COMPLETIONS)
    assert res.status == 200 and res.text == plain.text


async def test_engine_client_errors_pass_through(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("errors")
    wrong_model = await ask(http, router.url, {"model": "nope", "messages": messages, "conversation_id": "e"})
    assert wrong_model.status == 404
    assert wrong_model.body["error"]["type"] == "NotFoundError"
    assert "nope" in wrong_model.body["error"]["message"]
    too_long = await ask(http, router.url, {"messages": messages, "max_tokens": 10**6, "stream": True})
    assert too_long.status == 400 and "maximum context length" in too_long.body["error"]["message"]
    bad_ids = {"prompt": [1, -5, 2**40], "max_tokens": 3, "session_id": "s"}
    res = await ask(http, router.url, bad_ids, path="/v1/completions")
    assert res.status == 400 and res.body["error"]["type"] == "BadRequestError"


async def test_with_api_keys_only_their_holders_get_in(http: aiohttp.ClientSession) -> None:
    """--api-key, as vLLM's: a bearer key on /v1/ routes, 401 without one; the router's own
    endpoints stay open. Needed most with --engine-api-key, where the engines see only the
    router's key."""
    async with fake_engine() as p, fake_engine() as d:
        settings = router_settings(
            None,
            nodes__prefill_urls=(p.url,),
            nodes__decode_urls=(d.url,),
            server__api_keys=("k-one", "k-two"),
            upstream__api_key="engine-key",
        )
        async with Router(settings) as router:
            body = {"messages": [{"role": "user", "content": "hi"}]}
            for auth in (None, "Bearer k-three", "k-one", "Bearer k-on"):
                headers = {"Authorization": auth} if auth else {}
                async with http.post(router.url + CHAT, json=body, headers=headers) as r:
                    assert (r.status, await r.json()) == (401, {"error": "Unauthorized"}), auth
                async with http.get(router.url + "/v1/models", headers=headers) as r:
                    assert r.status == 401
            assert p.requests == [] and d.requests == []
            for key_two in ({"Authorization": "Bearer k-two"}, {"Authorization": "bearer k-two"}):
                async with http.post(router.url + CHAT, json=body, headers=key_two) as r:
                    assert r.status == 200
            for path in ("/health", "/metrics"):
                async with http.get(router.url + path) as r:
                    assert r.status == 200
            text = router.metrics.render()[0].decode()
            assert 'endpoint="/v1/chat/completions",status="401"} 4.0' in text
    assert [h["authorization"] for _, h, _ in d.requests] == ["Bearer engine-key"] * 2
    # (learning a static node's model asks with the engine key too: a vLLM with --api-key wants it)
    assert p.models_auth and set(p.models_auth) == {"Bearer engine-key"}


_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


_TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, _IMAGE]}]},
            "non_text_content",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL], "tool_choice": "none"},
            "prompt_not_reproducible",
        ),
        (  # (vLLM 0.32's Kimi K3 renderer puts these in the prompt; /tokenize has no field)
            {"messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL], "tool_choice": "required"},
            "prompt_not_reproducible",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "ls"}},
            },
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 100},
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "a", "text": "b"}]},
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
            "prompt_not_reproducible",
        ),
    ],
)
async def test_a_prompt_the_router_cannot_verify_is_served_plain_and_claims_nothing(
    daemon: Daemon, http: aiohttp.ClientSession, fields: dict[str, Any], reason: str
) -> None:
    """Two images of one size tokenize to the same placeholder ids, so the prompt's digests
    cannot tell a turn whose image changed from one whose image did not; and /tokenize
    does not render the prompt of a request with tool_choice "none" (an engine may leave
    the tools out), truncate_prompt_tokens, documents or reasoning_effort (which its
    chat request has no field for) as the request gets it, so P and D would
    compute other token ids than the request's. Such a turn is not looked up, not
    tokenized, and leaves nothing for D's sidecar to retain."""
    async with fakes_with_a_lease(daemon) as (p, d, leases):
        async with Router(on_fakes(daemon, p, d)) as router:
            chat = {**fields, "conversation_id": "c"}
            async with http.post(router.url + CHAT, json={**chat, "stream": True}) as r:
                assert r.status == 200 and b"t4" in await r.read()
                reuse = r.headers.get("X-Kvferry-Reuse"), r.headers.get("X-Kvferry-Reuse-Reason")
                assert reuse == ("SKIPPED", reason)
            value = router.metrics.value
            assert value("kvferry_router_lookups_total", decision="SKIPPED", reason=reason) == 1
        peek = await leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_tokens=10, peek=True))
        assert peek.reason not in ("already_claimed", "no_lease")  # still there, unclaimed
    paths = [path for path, _, _ in p.requests]
    assert paths == [CHAT]  # no /tokenize
    (_, _, p_chat) = p.requests[0]
    assert p_chat["messages"] == fields["messages"]
    assert "prompt_token_ids" not in p_chat["kv_transfer_params"]
    [(_, d_headers, d_chat)] = d.requests
    assert "x-conversation-id" not in d_headers and "conversation_id" not in d_chat
    assert d_headers["x-kvferry-no-retention"] == "1"  # (a body session_id would name it still)


async def test_several_answers_or_prompts_go_to_d_alone_without_params(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """P's params cover one sequence: a batch or n > 1 through P/D would hand D one prompt's
    blocks for all of them; no token ids describe a prompt given as embeddings. Those
    requests are D's alone, and claim no retention."""
    async with fakes_with_a_lease(daemon) as (p, d, leases):
        async with Router(on_fakes(daemon, p, d)) as router:
            chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "conversation_id": "c"}
            batch = {"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_prefill": True}}
            embeds = {"prompt_embeds": "AAAA", "conversation_id": "c"}
            cases = (
                (CHAT, chat, ("SKIPPED", "multiple_sequences")),
                ("/v1/completions", batch, (None, None)),
                ("/v1/completions", embeds, ("SKIPPED", "prompt_embeds")),
            )
            for path, body, told in cases:
                async with http.post(router.url + path, json={**body, "stream": True}) as r:
                    assert r.status == 200 and b"t4" in await r.read()
                    reuse = r.headers.get("X-Kvferry-Reuse"), r.headers.get("X-Kvferry-Reuse-Reason")
                    assert reuse == told
            value = router.metrics.value
            assert value("kvferry_router_lookups_total", decision="SKIPPED", reason="multiple_sequences") == 1
            assert value("kvferry_router_lookups_total", decision="SKIPPED", reason="prompt_embeds") == 1
        peek = await leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_tokens=10, peek=True))
        assert peek.reason not in ("already_claimed", "no_lease")  # still there, unclaimed
    assert p.requests == []
    [(_, d_headers, d_chat), (_, _, d_batch), (_, _, d_embeds)] = d.requests
    assert d_embeds["prompt_embeds"] == "AAAA" and "kv_transfer_params" not in d_embeds
    assert d_chat["n"] == 2 and "kv_transfer_params" not in d_chat and "conversation_id" not in d_chat
    assert "x-conversation-id" not in d_headers  # D retains nothing of it: its sidecar need not look
    assert d_batch["prompt"] == ["a", "b"] and "kv_transfer_params" not in d_batch

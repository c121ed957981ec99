"""What the engines receive from the router, and which nodes a request goes to: the
bodies and headers P and D get, models across nodes, the router's own endpoints."""

from __future__ import annotations

import contextlib
import json

import aiohttp
import pytest

from controlplane.daemon import Daemon
from router import Router
from tests.router.conftest import MakeStack, router_settings
from tests.router.fakes import fake_engine, on_fakes
from tests.router.helpers import CHAT, COMPLETIONS, ask, first_turn


async def test_what_the_engines_receive(daemon: Daemon, http: aiohttp.ClientSession) -> None:
    """P and D render the prompt themselves, as /tokenize did for the router: no token ids
    in their params (engines that do not take them would get 64k ids a turn for nothing)."""
    async with fake_engine() as p, fake_engine() as d:
        settings = on_fakes(daemon, p, d)
        async with Router(settings) as router:
            body = {
                "model": "fake",
                "messages": [{"role": "user", "content": "hi"}],
                "conversation_id": "secret-conv",
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": 50,
            }
            res = await ask(
                http, router.url, body, {"Authorization": "Bearer sk-1", "traceparent": "00-ab-cd-01"}
            )
            assert res.status == 200 and res.text == "t0t1t2t3t4" and res.events[-1] == "[DONE]"
    [(path, _, tok)] = p.requests[:1]
    assert path == "/tokenize" and tok == {"model": "fake", "messages": body["messages"]}
    (_, p_headers, p_body) = p.requests[1]
    assert p_body["stream"] is False and p_body["max_tokens"] == 1 and "stream_options" not in p_body
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert p_body["messages"] == body["messages"]
    [(_, d_headers, d_body)] = d.requests
    assert d_body["stream"] is True and d_body["max_tokens"] == 50
    assert d_body["kv_transfer_params"]["do_remote_prefill"] is True
    assert "prompt_token_ids" not in d_body["kv_transfer_params"]
    assert d_body["messages"] == body["messages"]
    for _, _, sent in [*p.requests, *d.requests]:
        assert "conversation_id" not in sent and "secret-conv" not in json.dumps(sent)
    assert d_headers["x-conversation-id"] == "secret-conv"
    assert d_headers["x-kvferry-tenant"].startswith("key-") and "sk-1" not in d_headers["x-kvferry-tenant"]
    assert "x-conversation-id" not in p_headers
    assert p_headers["x-request-id"] == d_headers["x-request-id"]
    assert d_headers["authorization"] == "Bearer sk-1" and d_headers["traceparent"] == "00-ab-cd-01"
    assert d_headers["accept-encoding"] == "identity"  # the router reads D's answer


async def test_forwarded_prompt_token_ids_go_on_chat_requests_only(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """--forward-prompt-token-ids: for engines that take a chat request's token ids in its
    kv_transfer_params instead of rendering it again (vLLM 0.32); a completion's are never
    read there (its prompt is text or token ids already)."""
    async with fake_engine() as p, fake_engine() as d:
        settings = on_fakes(daemon, p, d, upstream__forward_prompt_token_ids=True)
        async with Router(settings) as router:
            chat = {"messages": [{"role": "user", "content": "hi"}], "conversation_id": "c1", "stream": True}
            assert (await ask(http, router.url, chat)).status == 200
            completion = {"prompt": "hi", "conversation_id": "c2", "stream": True}
            assert (await ask(http, router.url, completion, path=COMPLETIONS)).status == 200
    prefills = [(path, sent) for path, _, sent in p.requests if path != "/tokenize"]
    assert [path for path, _ in prefills] == [CHAT, COMPLETIONS]
    assert prefills[0][1]["kv_transfer_params"]["prompt_token_ids"] == list(range(40))
    assert "prompt_token_ids" not in prefills[1][1]["kv_transfer_params"]
    (_, _, d_chat), (_, _, d_completion) = d.requests
    assert d_chat["kv_transfer_params"]["prompt_token_ids"] == list(range(40))
    assert "prompt_token_ids" not in d_completion["kv_transfer_params"]


async def test_a_request_goes_to_nodes_serving_its_model(http: aiohttp.ClientSession) -> None:
    """Two models behind one router: each turn uses a P and a D of the model it names, and
    /v1/models lists both. A name no node reports (an adapter's) may use any P, and then
    a D of that P's model."""
    async with contextlib.AsyncExitStack() as stack:
        pa, pb, pb2, da, db, da2 = [await stack.enter_async_context(fake_engine()) for _ in range(6)]
        pb.model = pb2.model = db.model = "other"
        prefills = (pa.url, pb.url, pb2.url)
        settings = router_settings(
            None, nodes__prefill_urls=prefills, nodes__decode_urls=(da.url, db.url, da2.url)
        )
        async with Router(settings) as router:
            pb.models_status = 500  # one of model "other"'s two P: the other answers for it
            for model in ("fake", "fake", "other", "fake", "other", "other", *["lora-x"] * 6):
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(router.url + CHAT, json=body) as r:
                    assert r.status == 200
            async with http.get(router.url + "/v1/models") as r:
                assert r.status == 200
                assert sorted(card["id"] for card in (await r.json())["data"]) == ["fake", "other"]
    model_of: dict[str, str] = {}  # request id -> the model of the P that prefilled it
    for p in (pa, pb, pb2):
        for _, headers, body in p.requests:
            assert body["model"] in (p.model, "lora-x")
            model_of[headers["x-request-id"]] = p.model
    for d in (da, db, da2):
        for _, headers, body in d.requests:
            assert body["model"] in (d.model, "lora-x") and model_of[headers["x-request-id"]] == d.model
    assert len(model_of) == 12


async def test_models_asks_each_node_of_unknown_model_and_stops_at_a_client_error(
    http: aiohttp.ClientSession,
) -> None:
    """Static prefill nodes whose model could not be learned yet each stand for
    themselves in /v1/models (they may serve different models); a 4xx from a node is the
    client's answer, not a reason to ask the model's next node."""
    async with fake_engine() as p1, fake_engine() as p2, fake_engine() as d:
        p2.model = "other"
        p1.models_status = p2.models_status = 500  # the router cannot learn their models
        settings = router_settings(
            None,
            nodes__prefill_urls=(p1.url, p2.url),
            nodes__decode_urls=(d.url,),
            daemon__nodes_refresh_s=3600,
        )
        async with Router(settings) as router:
            p1.models_status = p2.models_status = 200  # answering now, still unknown to the router
            async with http.get(router.url + "/v1/models") as r:
                assert r.status == 200
                assert sorted(card["id"] for card in (await r.json())["data"]) == ["fake", "other"]
    async with fake_engine() as pa, fake_engine() as pb, fake_engine() as d:
        settings = router_settings(None, nodes__prefill_urls=(pa.url, pb.url), nodes__decode_urls=(d.url,))
        async with Router(settings) as router:
            pa.models_status = pb.models_status = 401
            asked = len(pa.models_auth) + len(pb.models_auth)
            async with http.get(router.url + "/v1/models") as r:
                assert r.status == 401
            assert len(pa.models_auth) + len(pb.models_auth) == asked + 1  # one node asked, not both


async def test_health_models_and_metrics(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    stack = await make_stack()
    router = await stack.router()
    async with http.get(router.url + "/health") as r:
        assert r.status == 200
    async with http.get(router.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "kvferry/emulated-model"
    await ask(http, router.url, {"messages": first_turn("metrics"), "max_tokens": 5, "conversation_id": "m"})
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    for name in (
        'kvferry_router_lookups_total{decision="RECOMPUTE",reason="no_lease"} 1.0',
        'kvferry_router_nodes{role="prefill"} 1.0',
        "kvferry_router_ttft_seconds_bucket",
        "kvferry_router_request_seconds_bucket",
        'kvferry_router_stage_seconds_count{stage="lookup"} 1.0',
        'kvferry_router_stage_seconds_count{stage="digests"} 1.0',
    ):
        assert name in text, name
    with pytest.raises(ValueError, match="decode"):
        Router(router_settings(None, nodes__prefill_urls=("http://127.0.0.1:9",), nodes__decode_urls=()))

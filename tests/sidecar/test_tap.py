"""The HTTP tap over real HTTP: pass-through, streaming without buffering, token ids, errors."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import pytest

from controlplane.daemon import Daemon
from controlplane.settings import Limits
from emulator import EmulatorServer
from kvferry.v1 import leases_pb2, nodes_pb2
from sidecar import Sidecar
from tests.conftest import Client, DaemonFactory
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar, sidecar_settings
from tests.sidecar.helpers import chat, first_turn, prefill, sse_events


async def _pd(start_emulator: StartEmulator, **d_config: Any) -> tuple[EmulatorServer, EmulatorServer]:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode", **d_config)
    return p, d


async def _lease(client: Client, conversation: str, tenant: str = "") -> leases_pb2.Lease | None:
    try:
        return await client.leases.Get(
            leases_pb2.GetLeaseRequest(tenant=tenant, conversation_id=conversation)
        )
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND
        return None


async def test_token_ids_reach_the_client_only_when_asked(
    start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession, client: Client
) -> None:
    p, d = await _pd(start_emulator, stream_kv_transfer_params=True)  # (vLLM PR 40186)
    sc = await start_sidecar(d)
    messages = first_turn()
    conv = {"X-Conversation-Id": "ids"}

    direct = await chat(http, d.http_url, messages, max_tokens=8)
    plain = await chat(http, sc.url, messages, conv, max_tokens=8)
    assert plain.status == 200 and set(plain.body) == set(direct.body)
    assert plain.body["prompt_token_ids"] is None
    assert set(plain.body["choices"][0]) == set(direct.body["choices"][0])
    asked = await chat(http, sc.url, messages, conv, max_tokens=8, return_token_ids=True)
    assert len(asked.body["prompt_token_ids"]) > 100 and len(asked.body["choices"][0]["token_ids"]) == 8

    for return_ids in (False, True):
        async with http.post(
            sc.url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 5, "stream": True, "return_token_ids": return_ids},
            headers=conv,
        ) as r:
            events = await sse_events(r)
        text = json.dumps(events)
        assert ("token_ids" in text) is return_ids
        assert events[-1] == "[DONE]" and len(events) == 7  # role chunk, 5 tokens, [DONE]

    # A D turn streamed through the tap registers its retention from the final chunk.
    p1 = await prefill(http, p.http_url, messages)
    async with http.post(
        sc.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 12, "stream": True, "kv_transfer_params": p1.params},
        headers={"X-Session-ID": "streamed"},
    ) as r:
        events = await sse_events(r)
    final = events[-2]
    assert final["kv_transfer_params"]["do_remote_decode"] is True and "token_ids" not in json.dumps(events)
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    lease = await _lease(client, "streamed")
    assert lease is not None and lease.num_tokens == final["kv_transfer_params"]["remote_num_tokens"]
    assert len(lease.block_digests) == 16 * (lease.num_tokens // 16)


@pytest.mark.parametrize("tapped", [True, False])
async def test_streams_pass_through_unbuffered(
    start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession, tapped: bool
) -> None:
    d = await start_emulator(role="decode", decode_ms_per_token=100)  # (ms of jitter: small beside it)
    sc = await start_sidecar(d)
    headers = {"X-Conversation-Id": "slow"} if tapped else {}
    body = {"messages": first_turn(), "max_tokens": 20, "ignore_eos": True, "stream": True}
    began = time.perf_counter()
    arrivals: list[float] = []
    async with http.post(sc.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        async for raw in r.content:
            if raw.startswith(b"data: "):
                arrivals.append(time.perf_counter() - began)
    total = arrivals[-1]
    assert total >= 19 * 0.100  # the engine took its time
    assert arrivals[1] < total / 4, "the first token arrived only at the end: buffered"
    midway = sum(1 for t in arrivals if t < total / 2)
    assert 5 <= midway <= 15, f"tokens should trickle in, got arrivals {arrivals}"


async def test_client_leaving_mid_stream_registers_nothing(
    start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession, client: Client
) -> None:
    p, d = await _pd(start_emulator, decode_ms_per_token=20)
    sc = await start_sidecar(d)
    messages = first_turn()
    p1 = await prefill(http, p.http_url, messages)
    body = {"messages": messages, "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with http.post(
        sc.url + "/v1/chat/completions",
        json={**body, "kv_transfer_params": p1.params},
        headers={"X-Conversation-Id": "gone"},
    ) as r:
        async for raw in r.content:
            if b"content" in raw:
                break  # hang up after the first token
    await eventually(lambda: _metric(sc, "kvferry_sidecar_turns_total", outcome="unfinished"))
    assert await _lease(client, "gone") is None
    async with http.get(d.http_url + "/emulator/state") as r:
        assert (await r.json())["held_requests"] == {}, "the engine saw the abort and pinned nothing"


async def _metric(sc: Sidecar, name: str, **labels: str) -> bool:
    return sc.metrics.value(name, **labels) > 0


async def test_engine_answers_to_bad_input_pass_through(
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    make_daemon: DaemonFactory,
    connect: Callable[[Daemon], Client],
) -> None:
    p, d = await _pd(start_emulator)
    sc = await start_sidecar(d)
    conv = {"X-Conversation-Id": "bad"}
    async with http.post(sc.url + "/v1/chat/completions", data=b"{not json", headers=conv) as r:
        assert r.status == 400 and "error" in await r.json()
    unknown_model = await chat(http, sc.url, first_turn(), conv, model="nope", max_tokens=2)
    assert unknown_model.status == 404 and unknown_model.body["error"]["code"] == 404
    too_long = await chat(http, sc.url, first_turn(), conv, max_tokens=10**6)
    assert too_long.status == 400
    async with http.post(sc.url + "/v1/chat/completions", json=[1, 2], headers=conv) as r:
        assert r.status == 400
    # A daemon that refuses the registration for good (here: more tokens than it takes; an
    # id with control characters goes as a digest of itself, which it takes): the client
    # still gets its answer, and D is told to free the blocks no retention will ever hand
    # out (through a P).
    strict = await make_daemon(limits=Limits(max_tokens=100))
    refused = await start_sidecar(d, against=strict)
    p_node = (await start_sidecar(p, against=strict, engine__role="prefill")).settings.node_id

    async def p_alive() -> bool:  # (the release goes through it)
        listed = await connect(strict).nodes.List(nodes_pb2.ListNodesRequest())
        return any(n.engine_id == p_node and n.alive for n in listed.nodes)

    await eventually(p_alive)
    p1 = await prefill(http, p.http_url, first_turn())
    odd = await chat(
        http,
        refused.url,
        first_turn(),
        max_tokens=3,
        kv_transfer_params=p1.params,
        conversation_id="bad\x01id",
    )
    assert odd.status == 200 and odd.params is not None
    await eventually(lambda: _metric(refused, "kvferry_sidecar_lease_registrations_total", outcome="failed"))

    async def freed() -> bool:
        async with http.get(d.http_url + "/emulator/state") as r:
            return odd.params["remote_request_id"] not in (await r.json())["held_requests"]

    await eventually(freed, within=10)
    assert sc.metrics.value("kvferry_sidecar_turns_total", outcome="engine_status") == 2


async def test_engine_down_is_a_502_and_metrics_are_the_sidecars(
    start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    d = await start_emulator(role="decode")
    sc = await start_sidecar(d)
    async with http.get(sc.url + "/v1/models?x=1") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == d.config.model
    async with http.get(sc.url + "/kvferry/metrics") as r:
        text = await r.text()
        assert r.status == 200 and "kvferry_sidecar_proxied_requests_total" in text
    await d.stop()
    async with http.get(sc.url + "/v1/models") as r:
        assert r.status == 502 and (await r.json())["error"]["code"] == 502


async def test_what_the_engine_receives(
    echo_engine: str, daemon: Daemon, http: aiohttp.ClientSession, start_emulator: StartEmulator
) -> None:
    emu = await start_emulator()  # the settings' ports; the sidecar talks to the echo engine
    s = sidecar_settings(emu, daemon, engine__url=echo_engine, engine__model="m")
    async with Sidecar(s) as sc:
        body = {"model": "m", "messages": [], "conversation_id": "c-1", "session_id": "s-1"}
        async with http.post(
            sc.url + "/v1/chat/completions?trace=1",
            json=body,
            headers={"X-Custom": "yes", "Connection": "close"},
        ) as r:
            seen = await r.json()
            assert r.headers["X-Engine"] == "echo"
        sent = json.loads(seen["body"])
        assert sent == {"model": "m", "messages": [], "session_id": "s-1", "return_token_ids": True}
        assert seen["path_qs"] == "/v1/chat/completions?trace=1"
        assert seen["headers"]["X-Custom"] == "yes" and seen["headers"]["Accept-Encoding"] == "identity"
        async with http.post(sc.url + "/detokenize", data=b"raw \x00 bytes") as r:
            seen = await r.json()
        assert seen["method"] == "POST" and seen["body"] == "raw \x00 bytes"
        async with http.put(sc.url + "/anything/else", data=b"raw") as r:  # (not a serving path)
            assert r.status == 404 and "not served" in (await r.json())["error"]["message"]
        async with http.post(sc.url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert json.loads((await r.json())["body"]) == {"prompt": "hi"}  # no conversation: untouched
        # A compressed body is read decompressed, and goes on so: not as still compressed.
        # Headers the Connection header names are hop-by-hop, and a 100-continue is answered.
        packed = gzip.compress(json.dumps({"prompt": "zip"}).encode())
        headers = {
            "Content-Encoding": "gzip",
            "Content-Type": "application/json",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "1",
            "X-Kept": "1",
        }
        async with http.post(sc.url + "/v1/completions", data=packed, headers=headers, expect100=True) as r:
            seen = await r.json()
        assert json.loads(seen["body"]) == {"prompt": "zip"} and seen["headers"]["X-Kept"] == "1"
        assert not {"Content-Encoding", "X-Hop", "Expect"} & set(seen["headers"])
    async with Sidecar(replace(s, engine=replace(s.engine, role="prefill"))) as sc:
        async with http.post(sc.url + "/v1/chat/completions", json=body) as r:
            sent = json.loads((await r.json())["body"])
        assert sent == {"model": "m", "messages": [], "session_id": "s-1"}  # a prefill node reads nothing

"""Streamed D turns on an engine whose streams carry no kv_transfer_params (vLLM 0.32; the
emulator's default): served whole, and what D pins for them shown to an operator."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import structlog

from controlplane.daemon import Daemon
from emulator import EmulatorServer
from kvferry.v1 import nodes_pb2
from sidecar import Sidecar
from tests.cli.test_operator_tools import BIN, run
from tests.conftest import Client
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar
from tests.sidecar.helpers import chat, first_turn, prefill, sse_events

UNCAPTURED = "kvferry_sidecar_uncaptured_turns_total"
UNRETAINED = "kvferry_sidecar_unretained_blocks"


async def _streamed_turn(
    http: aiohttp.ClientSession,
    p: EmulatorServer,
    sc: Sidecar,
    messages: list[dict[str, Any]],
    conversation: str,
) -> list[Any]:
    """One P/D turn as the router runs it, D's answer streamed through the sidecar."""
    p1 = await prefill(http, p.http_url, messages)
    body = {"messages": messages, "max_tokens": 12, "stream": True, "kv_transfer_params": p1.params}
    async with http.post(
        sc.url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation}
    ) as r:
        assert r.status == 200
        return await sse_events(r)


def _text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict))


def _held_blocks(d: EmulatorServer) -> int:
    """The blocks D itself holds for remote readers, by its own account."""
    return sum(len(h["blocks"]) for h in d.engine.snapshot()["held_requests"].values())


async def _node(client: Client, engine_id: str) -> nodes_pb2.Node | None:
    listed = await client.nodes.List(nodes_pb2.ListNodesRequest())
    return next((n for n in listed.nodes if n.engine_id == engine_id and n.alive), None)


async def test_streamed_turns_without_params_are_served_counted_and_shown(
    client: Client,
    daemon: Daemon,
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")  # (vLLM 0.32: streams carry no params)
    sc = await start_sidecar(d)
    node_id = sc.settings.node_id
    await eventually(lambda: _node(client, node_id), within=30)
    messages = first_turn()
    alone = await chat(http, d.http_url, messages, max_tokens=12)  # (no params: pins nothing)
    assert _held_blocks(d) == 0

    with structlog.testing.capture_logs() as logs:
        answers = [await _streamed_turn(http, p, sc, messages, f"streamed-{n}") for n in range(2)]
    for events in answers:  # the client's whole answer, no error, nothing of the tap's
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert _text(events) == alone.content
        assert "error" not in json.dumps(events) and "token_ids" not in json.dumps(events)
    assert sc.metrics.value("kvferry_sidecar_turns_total", outcome="stream_without_params") == 2
    assert sc.metrics.value("kvferry_sidecar_turns_total", outcome="no_params") == 0
    assert sc.metrics.value(UNCAPTURED) == 2
    held = _held_blocks(d)
    assert held > 0 and sc.metrics.value(UNRETAINED) == held  # what D pins, block for block
    warned = [e for e in logs if e["event"] == "tap.stream.uncaptured" and e["log_level"] == "warning"]
    assert len(warned) == 1, warned  # once per engine process
    assert "PR 40186" in warned[0]["detail"] and "480 s" in warned[0]["detail"]

    async def shown() -> bool:
        n = await _node(client, node_id)
        return n is not None and (n.uncaptured_turns, n.unretained_blocks) == (2, held)

    await eventually(shown, within=30, interval=0.1)  # (the next heartbeat brings them)
    kvferry = str(BIN / "kvferry")
    code, out, err = await run(kvferry, "nodes", "ls", "--daemon", daemon.address)
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[-2:] == ["UNCAPTURED", "UNRETAINED"]
    [row] = [r for r in rows if r.startswith(node_id)]
    assert row.split()[-2:] == ["2", str(held)]
    code, out, err = await run(kvferry, "nodes", "ls", "--json", "--daemon", daemon.address)
    assert code == 0, err
    [listed] = [n for n in map(json.loads, out.splitlines()) if n["engine_id"] == node_id]
    assert (listed["uncaptured_turns"], listed["unretained_blocks"]) == ("2", str(held))  # (uint64: strings)

    # A new engine process holds nothing of the old one's; the turns stay counted.
    sc.instance.restart("identity")
    assert sc.metrics.value(UNRETAINED) == 0 and sc.metrics.value(UNCAPTURED) == 2


async def test_unretained_blocks_are_let_go_at_the_engines_ttl(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    ttl = 6.0  # (room for a busy machine between the answer and the first look)
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode", decoder_kv_blocks_ttl=ttl)
    sc = await start_sidecar(d, engine__blocks_ttl_s=ttl)
    await eventually(lambda: _node(client, sc.settings.node_id), within=30)
    start = time.monotonic()
    await _streamed_turn(http, p, sc, first_turn(), "short-lived")
    held = _held_blocks(d)
    assert held > 0 and sc.metrics.value(UNRETAINED) == held, time.monotonic() - start

    async def let_go() -> bool:
        return _held_blocks(d) == 0 and sc.metrics.value(UNRETAINED) == 0

    await eventually(let_go, within=ttl + 30, interval=0.1)
    assert time.monotonic() - start >= ttl  # (not before D's TTL)
    assert sc.metrics.value(UNCAPTURED) == 1


async def test_with_streamed_params_the_turn_is_captured_and_nothing_is_unretained(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode", stream_kv_transfer_params=True)  # (vLLM PR 40186)
    sc = await start_sidecar(d)
    node_id = sc.settings.node_id
    await eventually(lambda: _node(client, node_id), within=30)
    with structlog.testing.capture_logs() as logs:
        events = await _streamed_turn(http, p, sc, first_turn(), "captured")
    assert events[-2]["kv_transfer_params"]["do_remote_decode"] is True
    assert sc.metrics.value("kvferry_sidecar_turns_total", outcome="captured") == 1
    assert sc.metrics.value(UNCAPTURED) == 0 and sc.metrics.value(UNRETAINED) == 0
    assert not [e for e in logs if e["event"] == "tap.stream.uncaptured"]
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    assert sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="sent") == 1
    n = await _node(client, node_id)
    assert n is not None and (n.uncaptured_turns, n.unretained_blocks) == (0, 0)

"""Orphan pins end to end: D's blocks of a registration the sidecar gave up on are freed
through a prefill node when no retention can name them, and a live retention's never.

Everything is real: the daemon on etcd, emulated P and D with their sidecars; D's held
requests are read from the emulator's /emulator/state.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import aiohttp

from emulator import EmulatorServer
from kvferry.v1 import leases_pb2, nodes_pb2
from sidecar import Sidecar
from sidecar.drafts import RetentionDraft
from tests.conftest import Client
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar
from tests.sidecar.helpers import chat, first_turn, next_turn, params_of, prefill, tokenize

ORPHANS = "kvferry_sidecar_orphans_total"
RELEASES = "kvferry_sidecar_releases_total"


async def _held(http: aiohttp.ClientSession, emu: EmulatorServer) -> dict[str, Any]:
    async with http.get(emu.http_url + "/emulator/state") as r:
        state: dict[str, Any] = await r.json()
    held: dict[str, Any] = state["held_requests"]
    return held


async def _alive(client: Client, *engine_ids: str) -> bool:
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    return set(engine_ids) <= {n.engine_id for n in nodes if n.alive}


async def _stack(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, **changes: Any
) -> tuple[EmulatorServer, EmulatorServer, Sidecar]:
    """An emulated P and D, each behind its sidecar, both alive at the daemon."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    p_sc = await start_sidecar(p, engine__role="prefill")
    d_sc = await start_sidecar(d, **changes)
    await eventually(lambda: _alive(client, p_sc.settings.node_id, d_sc.settings.node_id), within=10)
    return p, d, d_sc


async def _pinned_turn(http: aiohttp.ClientSession, p: EmulatorServer, d: EmulatorServer, topic: str) -> Any:
    """A turn D answers with params (sent to D's engine itself: the sidecar drafts nothing)
    -> D's params; D pins its blocks."""
    messages = first_turn(topic)
    p1 = await prefill(http, p.http_url, messages)
    d1 = await chat(http, d.http_url, messages, max_tokens=8, kv_transfer_params=p1.params)
    assert d1.status == 200 and d1.params is not None, d1.body
    return d1.params


def _draft(sc: Sidecar, params: dict[str, Any], conversation_id: str) -> RetentionDraft:
    """The draft the tap would make of D's answer (its side-channel host the node's)."""
    params = {**params, "remote_host": "127.0.0.1"}
    return RetentionDraft(
        "acme",
        conversation_id,
        params,
        params["remote_num_tokens"],
        time.time() + 400,
        None,
        "",
        sc.instance.epoch,
    )


async def test_a_refused_registration_and_an_overflowed_one_free_ds_blocks(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """One draft refused by the daemon (a conversation id past its limit: INVALID_ARGUMENT)
    and one pushed out of a full queue before it was sent: neither is stored anywhere, so
    D is told to free their blocks. A live retention's blocks stay held, and a P pulls them."""
    p, d, sc = await _stack(client, start_emulator, start_sidecar, retentions__queue_size=1)
    messages = first_turn("lighthouses")
    p1 = await prefill(http, p.http_url, messages)
    headers = {"X-Conversation-Id": "live", "X-Kvferry-Tenant": "acme"}
    live = await chat(http, sc.url, messages, headers, max_tokens=8, kv_transfer_params=p1.params)
    assert live.status == 200 and live.params is not None
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)

    refused = await _pinned_turn(http, p, d, "tides")
    overflowed = await _pinned_turn(http, p, d, "sandbanks")
    kept = await _pinned_turn(http, p, d, "buoys")
    ids = {x["remote_request_id"] for x in (live.params, refused, overflowed, kept)}
    assert ids <= set(await _held(http, d))

    sc.retentions.submit(_draft(sc, refused, "c" * 300))
    assert await sc.retentions.wait_idle(10)
    sc.retentions.submit(_draft(sc, overflowed, "overflowed"))
    sc.retentions.submit(_draft(sc, kept, "kept"))  # (the queue holds one: the first goes)
    assert await sc.retentions.wait_idle(10)

    async def freed() -> bool:
        held = await _held(http, d)
        return refused["remote_request_id"] not in held and overflowed["remote_request_id"] not in held

    await eventually(freed, within=15)
    held = await _held(http, d)
    assert live.params["remote_request_id"] in held and kept["remote_request_id"] in held
    m = sc.metrics
    assert m.value(ORPHANS, reason="failed", action="released") == 1
    assert m.value(ORPHANS, reason="overflow", action="released") == 1
    assert m.value(RELEASES, reason="orphan") == 2
    assert m.value("kvferry_sidecar_orphan_blocks", reason="overflow") == 0

    # the live retention still hands out blocks D holds: P pulls them, and reads no freed block
    second = next_turn(messages, live.content)
    prompt = await tokenize(http, p.http_url, second)
    decision = await client.leases.Lookup(
        leases_pb2.LookupRequest(tenant="acme", conversation_id="live", prompt_tokens=len(prompt))
    )
    assert decision.decision == leases_pb2.PULL, decision
    p2 = await prefill(http, p.http_url, second, params_of(decision.kv_transfer_params))
    assert p2.status == 200 and p2.pull == "pulled", p2.body
    async with http.get(d.http_url + "/emulator/state") as r:
        assert (await r.json())["unheld_reads"] == 0


async def test_a_maybe_stored_registration_is_counted_not_released_and_shown(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """A draft dropped as maybe stored (the daemon may hold a retention naming its blocks):
    never released from the sidecar, its blocks counted by reason and in the node's
    UNRETAINED column until D's TTL frees them."""
    p, d, sc = await _stack(client, start_emulator, start_sidecar)
    params = await _pinned_turn(http, p, d, "harbour walls")
    assert sc.retentions is not None
    draft = _draft(sc, params, "doubtful")
    sc.retentions._drop(draft, "maybe_stored")  # (what _failed does with an unclear answer)
    blocks = -(-params["remote_num_tokens"] // 16)
    m = sc.metrics
    assert m.value(ORPHANS, reason="maybe_stored", action="counted") == 1
    assert m.value("kvferry_sidecar_orphan_blocks", reason="maybe_stored") == blocks
    assert m.value("kvferry_sidecar_unretained_blocks") == blocks

    async def shown() -> bool:
        nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
        return any(n.engine_id == sc.settings.node_id and n.unretained_blocks == blocks for n in nodes)

    await eventually(shown, within=15)
    assert params["remote_request_id"] in await _held(http, d)
    assert m.value(RELEASES, reason="orphan") == 0


async def test_an_uncaptured_turns_blocks_are_shown_by_reason(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """A streamed turn whose answer names no blocks (vLLM without PR 40186, the emulator's
    default): nothing can release them, so they are counted under their own reason, as
    many as D holds by its own account, with the dropped registrations' in one total."""
    p, d, sc = await _stack(client, start_emulator, start_sidecar)
    messages = first_turn("mooring lines")
    p1 = await prefill(http, p.http_url, messages)
    body = {"messages": messages, "max_tokens": 12, "stream": True, "kv_transfer_params": p1.params}
    async with http.post(sc.url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": "s"}) as r:
        assert r.status == 200
        await r.read()
    held = sum(len(h["blocks"]) for h in (await _held(http, d)).values())
    assert held > 0
    m = sc.metrics

    async def shown() -> bool:  # (the tap concludes the turn once it has written the answer)
        return m.value("kvferry_sidecar_orphan_blocks", reason="stream_without_params") == held

    await eventually(shown)
    assert sc.retentions is not None
    sc.retentions._drop(_draft(sc, await _pinned_turn(http, p, d, "quays"), "q"), "cancelled")
    counted = m.value("kvferry_sidecar_orphan_blocks", reason="cancelled")
    assert counted > 0 and m.value("kvferry_sidecar_unretained_blocks") == held + counted


async def test_counted_pins_go_with_ds_ttl_and_an_expired_draft_pins_nothing(
    start_emulator: StartEmulator, start_sidecar: StartSidecar, client: Client, http: aiohttp.ClientSession
) -> None:
    """D's own TTL (3 s here) frees a maybe-stored turn's blocks: the count follows D's
    holds down to 0. A draft dropped past its deadline is neither released nor counted."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode", decoder_kv_blocks_ttl=3.0)
    p_sc = await start_sidecar(p, engine__role="prefill")
    sc = await start_sidecar(d, engine__blocks_ttl_s=3.0)
    await eventually(lambda: _alive(client, p_sc.settings.node_id, sc.settings.node_id), within=10)
    params = await _pinned_turn(http, p, d, "slipways")
    assert sc.retentions is not None
    draft = _draft(sc, params, "doubtful")
    sc.retentions._drop(replace(draft, expires_at=time.time() + 3.0), "maybe_stored")
    m = sc.metrics
    assert m.value("kvferry_sidecar_orphan_blocks", reason="maybe_stored") > 0

    async def gone_with_ds_hold() -> bool:
        held = params["remote_request_id"] in await _held(http, d)
        return not held and m.value("kvferry_sidecar_orphan_blocks", reason="maybe_stored") == 0

    await eventually(gone_with_ds_hold, within=15)
    sc.retentions._drop(replace(draft, expires_at=time.time() - 1), "overflow")
    assert m.value(ORPHANS, reason="overflow", action="released") == 0
    assert m.value(RELEASES, reason="orphan") == 0 and m.value("kvferry_sidecar_unretained_blocks") == 0

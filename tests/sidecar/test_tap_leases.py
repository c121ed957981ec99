"""A decode turn through the tap registers a retention the daemon hands to a prefill node."""

from __future__ import annotations

import time

import aiohttp

from kvferry.digests import block_digests, seed
from kvferry.turnheaders import CONVERSATION_HEADER, TENANT_HEADER, TURN_ID_HEADER, conversation_of
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar
from tests.sidecar.helpers import chat, first_turn, next_turn, params_of, prefill, tokenize

MODEL = "kvferry/emulated-model"


async def _node_alive(client: Client, engine_id: str) -> bool:
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    return any(n.engine_id == engine_id and n.alive for n in nodes)


async def test_decode_turn_registers_a_retention_that_prefill_pulls(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode", side_channel_host="localhost")
    sc = await start_sidecar(d)
    node_id = sc.settings.node_id
    await eventually(lambda: _node_alive(client, node_id))

    messages = first_turn()
    p1 = await prefill(http, p.http_url, messages)
    headers = {"X-Conversation-Id": "conv-1", "X-Kvferry-Tenant": "acme"}
    d1 = await chat(
        http, sc.url, messages, headers, max_tokens=40, kv_transfer_params=p1.params, return_token_ids=True
    )
    assert d1.status == 200, d1.body
    d_params = d1.params
    assert d_params is not None and d_params["do_remote_decode"] is True
    assert d_params["remote_host"] == "localhost"  # the client sees what the engine said
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    assert sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="sent") == 1

    lease = await client.leases.Get(leases_pb2.GetLeaseRequest(tenant="acme", conversation_id="conv-1"))
    n = d_params["remote_num_tokens"]
    sequence = (d1.body["prompt_token_ids"] + d1.body["choices"][0]["token_ids"])[:n]
    assert lease.engine_id == node_id and lease.num_tokens == n and lease.block_size == 16
    assert lease.block_digests == block_digests(sequence, 16, seed(MODEL))
    stored = params_of(lease.kv_transfer_params)
    assert stored == {**d_params, "remote_host": "127.0.0.1"}
    assert 470 < lease.expires_at.ToNanoseconds() / 1e9 - time.time() <= 480

    second = next_turn(messages, d1.content)
    prompt = await tokenize(http, p.http_url, second)
    decision = await client.leases.Lookup(
        leases_pb2.LookupRequest(
            tenant="acme",
            conversation_id="conv-1",
            prompt_tokens=len(prompt),
            prompt_digests=block_digests(prompt, 16, seed(MODEL)),
        )
    )
    assert decision.decision == leases_pb2.PULL, decision
    handout = params_of(decision.kv_transfer_params)
    assert handout["remote_host"] == "127.0.0.1" and handout["remote_port"] == d.side_channel_port

    p2 = await prefill(http, p.http_url, second, handout)
    assert p2.status == 200, p2.body
    assert p2.pull == "pulled" and p2.count("pulled") == decision.reusable_tokens
    d2 = await chat(
        http, sc.url, second, {"X-Conversation-Id": "conv-1"}, max_tokens=40, kv_transfer_params=p2.params
    )
    reference = await start_emulator()
    alone = await chat(http, reference.http_url, second, max_tokens=40)
    assert d2.content == alone.content


async def test_a_draft_whose_params_a_struct_cannot_hold_is_refused_and_the_sender_goes_on(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """An integer beyond a double (a protobuf Struct's numbers) in D's params: that one
    registration fails with a log line; the sender, and the drafts after it, go on."""
    from dataclasses import replace

    from sidecar.drafts import RetentionDraft

    d = await start_emulator(role="decode")
    sc = await start_sidecar(d)
    await eventually(lambda: _node_alive(client, sc.settings.node_id))
    messages = first_turn()
    headers = {"X-Conversation-Id": "good", "X-Kvferry-Tenant": "acme"}
    p1 = await prefill(http, (await start_emulator(role="prefill")).http_url, messages)
    d1 = await chat(http, sc.url, messages, headers, max_tokens=8, kv_transfer_params=p1.params)
    assert d1.status == 200 and sc.retentions is not None and await sc.retentions.wait_idle(5)
    await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(tenant="acme", conversation_id="good"))
    sent = sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="sent")

    assert d1.params is not None
    good = RetentionDraft(
        "acme",
        "good",
        d1.params,
        d1.params["remote_num_tokens"],
        time.time() + 400,
        None,
        "",
        sc.instance.epoch,
    )
    huge = replace(good, conversation_id="huge", params={**good.params, "x": 10**400})
    sc.retentions.submit(huge)
    sc.retentions.submit(good)
    assert await sc.retentions.wait_idle(5)
    assert sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="sent") == sent + 1
    assert sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="failed") == 1
    await client.leases.Get(leases_pb2.GetLeaseRequest(tenant="acme", conversation_id="good"))


async def test_a_turn_the_router_marks_no_retention_registers_nothing(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """A body session_id names the conversation to the tap whatever the router leaves out:
    the router's no-retention header (a turn with an image, several answers) wins."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    sc = await start_sidecar(await start_emulator(role="decode"))
    await eventually(lambda: _node_alive(client, sc.settings.node_id))
    messages = first_turn()
    for name, extra in (("marked", {"X-Kvferry-No-Retention": "1"}), ("kept", {})):
        p1 = await prefill(http, p.http_url, messages)
        d1 = await chat(
            http, sc.url, messages, extra, max_tokens=8, kv_transfer_params=p1.params, session_id=name
        )
        assert d1.status == 200, d1.body
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    listed = await client.leases.List(leases_pb2.ListLeasesRequest(all_tenants=True))
    assert [lease.conversation_id for lease in listed.leases] == ["kept"]


async def test_a_sidecar_with_another_tenant_header_keeps_the_routers_tenant(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """--tenant-header names the header of other front doors: a turn the router sent (it
    carries the turn id) is registered under the tenant the router named, which is the one
    the router looks it up under. Conversation ids are made safe by the router's rule."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    sc = await start_sidecar(await start_emulator(role="decode"), tap__tenant_header="X-Team")
    await eventually(lambda: _node_alive(client, sc.settings.node_id))
    messages = first_turn()
    long = "c" * 300  # (longer than the daemon takes)
    for headers in (
        {CONVERSATION_HEADER: "routed", TURN_ID_HEADER: "kvf-1", TENANT_HEADER: "acme", "X-Team": "beta"},
        {CONVERSATION_HEADER: "direct", "X-Team": "beta"},
        {CONVERSATION_HEADER: long, "X-Team": "beta"},
    ):
        p1 = await prefill(http, p.http_url, messages)
        d1 = await chat(http, sc.url, messages, headers, max_tokens=8, kv_transfer_params=p1.params)
        assert d1.status == 200, d1.body
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    listed = await client.leases.List(leases_pb2.ListLeasesRequest(all_tenants=True))
    assert sorted((lease.tenant, lease.conversation_id) for lease in listed.leases) == [
        ("acme", "routed"),
        ("beta", conversation_of({CONVERSATION_HEADER: long}, {})),
        ("beta", "direct"),
    ]

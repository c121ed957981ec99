"""A conversation's end and the retention budget, end to end with emulated engines: a
client's last turn (``X-Conversation-End: true``) leaves nothing held on D, ``DELETE
/v1/conversations/{id}`` frees what D holds for the next turn, and a D over its budget
has its retention released by the daemon (D's sidecar reports D's pool on its
heartbeats)."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import grpc
import pytest

from controlplane.budget import Budget
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import DaemonFactory, daemon_settings
from tests.polling import eventually
from tests.router.conftest import MakeStack, one_turn_held
from tests.router.helpers import ask, first_turn, next_turn


async def _no_retention(stack, conversation: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id=conversation))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


async def test_a_last_turn_leaves_nothing_held_on_d(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    stack = await make_stack()
    router = await stack.router()
    [d] = stack.decodes
    body = {"messages": first_turn("endings"), "max_tokens": 10, "conversation_id": "last-one"}
    one = await ask(http, router.url, body, headers={"X-Conversation-End": "true"})
    assert one.status == 200, one.body
    await stack.registrations_idle()

    async def freed() -> bool:
        return not d.engine.snapshot()["held_requests"]

    await eventually(freed, within=20)
    await _no_retention(stack, "last-one")
    metrics = stack.sidecar(d).metrics
    assert metrics.turns.labels("conversation_end")._value.get() == 1
    assert metrics.releases.labels("conversation_end")._value.get() == 1
    # A client cannot set the router's own header: dropped, the turn is retained as usual.
    body = {"messages": first_turn("forged"), "max_tokens": 10, "conversation_id": "kept"}
    two = await ask(http, router.url, body, headers={"X-Kvferry-Conversation-End": "1"})
    assert two.status == 200
    await stack.registrations_idle()
    await stack.client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="kept"))


async def test_delete_ends_a_conversation_and_d_frees_its_blocks(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    stack, d, body, one, held = await one_turn_held(make_stack, http, "deleting", "delete-me")
    [router] = stack.routers
    async with http.delete(router.url + "/v1/conversations/delete-me") as r:
        assert r.status == 200, await r.text()
        assert await r.json() == {"id": "delete-me", "object": "conversation.deleted", "deleted": True}

    async def freed() -> bool:  # (the release goes out with D's sidecar's next heartbeat)
        return held not in d.engine.snapshot()["held_requests"]

    await eventually(freed, within=20)
    await _no_retention(stack, "delete-me")
    second = {**body, "messages": next_turn(body["messages"], one.text)}
    two = await ask(http, router.url, second)
    assert (two.decision, two.reason) == ("RECOMPUTE", "no_lease")
    # Ended already: nothing is retained of it.
    async with http.delete(router.url + "/v1/conversations/never-was") as r:
        assert r.status == 404
        error = (await r.json())["error"]
        assert error["message"] == "no turn of conversation 'never-was' is retained"


async def test_delete_without_a_daemon_says_so(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    from router.app import Router
    from tests.router.conftest import router_settings

    stack = await make_stack()
    [p], [d] = stack.prefills, stack.decodes
    r = Router(router_settings(None, nodes__prefill_urls=(p.http_url,), nodes__decode_urls=(d.http_url,)))
    await r.start()
    stack.routers.append(r)
    async with http.delete(r.url + "/v1/conversations/c-1") as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "this router has no daemon: it retains nothing"


async def test_a_d_over_its_budget_has_its_retention_released(
    make_stack: MakeStack, make_daemon: DaemonFactory, etcd_endpoint: str, http: aiohttp.ClientSession
) -> None:
    # 4,096 blocks, of which retentions may hold 2: any turn's retention is over budget.
    daemon = await make_daemon(replace(daemon_settings(etcd_endpoint), budget=Budget(2 / 4096, 0.9)))
    stack = await make_stack(daemon=daemon, d_config={"num_blocks": 4096})
    router = await stack.router()
    [d] = stack.decodes
    d_id = stack.sidecar(d).settings.node_id

    async def pool_reported() -> bool:
        listed = await stack.client.nodes.List(nodes_pb2.ListNodesRequest(local_only=True))
        return any(n.engine_id == d_id and n.pool_blocks == 4096 for n in listed.nodes)

    await eventually(pool_reported, within=20)
    body = {"messages": first_turn("budgets", size=12), "max_tokens": 10, "conversation_id": "over"}
    one = await ask(http, router.url, body)
    assert one.status == 200
    await stack.registrations_idle()

    async def released() -> bool:
        return not d.engine.snapshot()["held_requests"]

    await eventually(released, within=20)
    await _no_retention(stack, "over")

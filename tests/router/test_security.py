"""The router's part of issue 21, as attacks: a client names its tenant by its API key alone.

A client-sent ``X-Kvferry-*`` header (the tenant, the turn id, any other) is dropped
before anything reads it; a client guessing another tenant's conversation and prompt
learns nothing from ``X-Kvferry-Reused-Tokens``: its lookup is in its own tenant.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from structlog.testing import capture_logs

from controlplane.daemon import Daemon
from kvferry.turnheaders import key_tenant
from kvferry.v1 import leases_pb2
from router import Router
from tests.router.conftest import MakeStack, Stack
from tests.router.fakes import fake_engine, on_fakes
from tests.router.helpers import ask, first_turn, next_turn

FORGED = {
    "X-Kvferry-Tenant": "acme",
    "X-Kvferry-Turn-Id": "forged-turn",
    "x-kvferry-no-retention": "1",
    "X-KVFERRY-REUSE": "PULL",
}
"""kvferry's own headers, as a client might forge them (any case)."""


async def _tenants_of(stack: Stack, conversation: str) -> set[str]:
    """The tenants holding a retention of `conversation`."""
    listed = await stack.client.leases.List(leases_pb2.ListLeasesRequest(all_tenants=True))
    return {lease.tenant for lease in listed.leases if lease.conversation_id == conversation}


async def test_kvferry_headers_a_client_sends_never_reach_an_engine(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """D's sidecar gets the router's tenant (the key's) and turn id, never the client's."""
    async with fake_engine() as p, fake_engine() as d, Router(on_fakes(daemon, p, d)) as router:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "conversation_id": "c"}
        res = await ask(
            http, router.url, {**body, "stream": True}, {**FORGED, "Authorization": "Bearer sk-1"}
        )
        assert res.status == 200 and res.text == "t0t1t2t3t4"
        keyless = await ask(http, router.url, {**body, "stream": True}, FORGED)
        assert keyless.status == 200
    (_, keyed, _), (_, anonymous, _) = d.requests
    assert keyed["x-kvferry-tenant"] == key_tenant("sk-1")
    assert "x-kvferry-tenant" not in anonymous  # no key: the default tenant, whatever was named
    for headers in (keyed, anonymous):
        assert headers["x-kvferry-turn-id"].startswith("kvf-")
        assert "x-kvferry-no-retention" not in headers and "x-kvferry-reuse" not in headers
    for _, headers, _ in p.requests:
        assert not any(name.startswith("x-kvferry-") and name != "x-kvferry-turn-id" for name in headers)
        assert headers["x-kvferry-turn-id"] != "forged-turn"


async def test_a_client_named_tenant_has_no_effect(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """Without keys (development) every key-less client is the default tenant: a turn that
    names "acme" is retained there, and the next turn, naming nothing, pulls it."""
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("tenants")
    body: dict[str, Any] = {"messages": messages, "max_tokens": 20, "conversation_id": "named"}
    one = await ask(http, router.url, body, {"X-Kvferry-Tenant": "acme"})
    assert one.status == 200
    await stack.registrations_idle()
    assert await _tenants_of(stack, "named") == {"default"}
    two = await ask(http, router.url, {**body, "messages": next_turn(messages, one.text)})
    assert two.status == 200 and two.decision == "PULL" and two.reused > 0


async def test_another_tenant_guessing_a_conversation_learns_nothing(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """Bob, with his own key, sends Alice's conversation id and her very next prompt (the
    best guess there is), naming her tenant in the header or not: his lookup is in his own
    tenant, so X-Kvferry-Reused-Tokens says 0, and Alice's retention is neither read nor
    spent. (One key per probe: each probe's own turn is retained in its own tenant.)"""
    stack = await make_stack()
    probers = ("sk-bob", "sk-carol", "sk-dave")
    router = await stack.router(server__api_keys=("sk-alice", *probers))
    alice = {"Authorization": "Bearer sk-alice"}
    messages = first_turn("secrets")
    body: dict[str, Any] = {"messages": messages, "max_tokens": 20, "conversation_id": "alice-1"}
    one = await ask(http, router.url, body, alice)
    assert one.status == 200
    await stack.registrations_idle()
    assert await _tenants_of(stack, "alice-1") == {key_tenant("sk-alice")}

    guess = {**body, "messages": next_turn(messages, one.text)}
    forgeries: tuple[dict[str, str], ...] = (
        {},
        {"X-Kvferry-Tenant": key_tenant("sk-alice")},
        {"x-kvferry-tenant": ""},
    )
    for key, forged in zip(probers, forgeries, strict=True):
        probe = await ask(http, router.url, guess, {"Authorization": f"Bearer {key}", **forged})
        assert probe.status == 200, forged
        assert (probe.decision, probe.reason, probe.reused) == ("RECOMPUTE", "no_lease", 0), forged
        assert probe.headers["X-Kvferry-Reused-Tokens"] == "0"
    await stack.registrations_idle()
    tenants = {key_tenant(k) for k in ("sk-alice", *probers)}
    assert await _tenants_of(stack, "alice-1") == tenants  # each retained in its own
    # Alice's own next turn still pulls what D kept for her.
    two = await ask(http, router.url, guess, alice)
    assert two.status == 200 and two.decision == "PULL" and two.reused > 0
    # A client with no key, or a made-up one, gets 401 before anything is looked up, and
    # each refusal leaves an audit line.
    lookups = router.metrics.value("kvferry_router_lookups_total", decision="RECOMPUTE", reason="no_lease")
    with capture_logs() as logged:
        for headers in (
            {},
            {"Authorization": "Bearer sk-mallory"},
            {"X-Kvferry-Tenant": key_tenant("sk-alice")},
        ):
            refused = await ask(http, router.url, guess, headers)
            assert (refused.status, refused.body) == (401, {"error": "Unauthorized"}), headers
    audits = [(e["action"], e["code"], e["reason"]) for e in logged if e["event"] == "audit.denied"]
    chat = "POST /v1/chat/completions"
    assert audits == [
        (chat, "unauthenticated", "no identity: no API key given"),
        (chat, "unauthenticated", "no identity: an API key of the router's is needed"),
        (chat, "unauthenticated", "no identity: no API key given"),
    ]
    assert (
        router.metrics.value("kvferry_router_lookups_total", decision="RECOMPUTE", reason="no_lease")
        == lookups
    )

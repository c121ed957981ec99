"""A daemon that is gone or late: turns are served without reuse, and blocks it claimed
for a turn that went on without them are freed (or left to the turn that owns them)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from kvferry.v1 import leases_pb2
from realvllm.process import free_port
from router import Router
from tests.polling import eventually
from tests.router.conftest import MakeStack, Reference, one_turn_held, router_settings
from tests.router.helpers import CHAT, answers_late, ask, first_turn, next_turn, unheld_reads


async def test_without_a_daemon_turns_are_served_without_reuse(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    await stack.wait_nodes()
    [p], [d] = stack.prefills, stack.decodes
    nodes = {"nodes__prefill_urls": (stack.sidecar(p).url,), "nodes__decode_urls": (stack.sidecar(d).url,)}
    messages = first_turn("absence")
    body = {"messages": messages, "max_tokens": 10, "conversation_id": "gone"}

    gone = Router(
        router_settings(
            None,
            daemon__addresses=(f"127.0.0.1:{free_port()}",),
            daemon__breaker_base_s=30.0,
            daemon__breaker_max_s=30.0,
            **nodes,
        )
    )
    async with gone:
        for expect in ("daemon_unavailable", "daemon_backoff"):
            res = await ask(http, gone.url, body)
            assert res.status == 200 and (res.decision, res.reason) == ("SKIPPED", expect)
            assert res.text == await reference(CHAT, body)

    answers_late(stack.daemon, 0.05)  # (answered from memory, it could beat even 1 us)
    late = Router(
        router_settings(
            stack.daemon, daemon__lookup_deadline_s=1e-6, daemon__lookup_recompute_share=0, **nodes
        )
    )
    async with late:
        res = await ask(http, late.url, body)
        assert res.status == 200 and (res.decision, res.reason) == ("SKIPPED", "daemon_timeout")
        assert res.text == await reference(CHAT, body)


async def test_a_claim_answered_late_has_ds_blocks_freed_through_p(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """The lookup's answer came after its deadline: the turn went on without reuse, but the
    daemon claimed the previous turn's blocks on D. Nothing would pull them, so D would keep
    them for its TTL (480 s); the router has P tell D to free them now."""
    stack, d, body, one, first = await one_turn_held(make_stack, http, "lateness", "late-claim")
    messages = body["messages"]

    answers_late(stack.daemon, 0.05)
    late = await stack.router(daemon__lookup_deadline_s=1e-6, daemon__lookup_recompute_share=0)
    second = {**body, "messages": next_turn(messages, one.text)}
    two = await ask(http, late.url, second)
    assert two.status == 200 and (two.decision, two.reason) == ("SKIPPED", "daemon_timeout")
    assert two.text == await reference(CHAT, second)

    async def released() -> bool:
        done = late.metrics.value("kvferry_router_claim_releases_total", outcome="released")
        return done == 1 and first not in d.engine.snapshot()["held_requests"]

    await eventually(released)
    assert len(d.engine.snapshot()["held_requests"]) == 1  # turn two's, for the next turn
    [p] = stack.prefills

    async def nothing_on_p() -> bool:  # (turn two's prompt: until D has pulled it)
        return not p.engine.snapshot()["held_requests"]

    await eventually(nothing_on_p)  # P refused the release before admission: it kept nothing
    assert unheld_reads(stack.decodes) == 0


class _SlowWrites:
    """A Leases/Stream call whose writes leave only once `gate` is set (a stream still being
    set up, a congested connection): ops sent in time reach the daemon late."""

    def __init__(self, call: Any, gate: asyncio.Event) -> None:
        self._call, self._gate = call, gate

    async def write(self, batch: Any) -> None:
        await self._gate.wait()
        await self._call.write(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


async def test_a_claim_reaching_the_daemon_after_its_own_turn_registered_leaves_that_retention(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """Turn two's lookup leaves in time but reaches the daemon only after turn two, served
    without reuse, has registered its own retention. Claimed and released (as any late
    claim is), those blocks would be lost to turn three; the daemon leaves them to it.
    Turn one's retention, replaced without a claim, has its blocks freed through P."""
    stack, d, body, one, first = await one_turn_held(make_stack, http, "own turn", "own-turn")
    messages = body["messages"]
    [router] = stack.routers

    slow = await stack.router(daemon__lookup_deadline_s=0.05)
    assert slow.daemon is not None
    leases = slow.daemon._replica.stream
    await leases.close()  # (the stream opened at start) the next one is slow to send
    real = leases._opener
    gate = asyncio.Event()
    leases._opener = lambda: _SlowWrites(real(), gate)
    second = {**body, "messages": next_turn(messages, one.text)}
    two = await ask(http, slow.url, second)
    assert two.status == 200 and (two.decision, two.reason) == ("SKIPPED", "daemon_timeout")
    await stack.registrations_idle()
    get = leases_pb2.GetLeaseRequest(conversation_id="own-turn")
    registered = await stack.client.leases.Get(get)
    assert registered.request_id == two.headers["X-Request-ID"]  # turn two's own
    gate.set()  # (only now does turn two's lookup reach the daemon)

    async def lookup_arrived() -> bool:
        return (await stack.client.leases.Get(get)).revision != registered.revision

    await eventually(lookup_arrived)  # the late claim took it, and put it back
    after = await stack.client.leases.Get(get)
    assert not after.claimed and after.request_id == registered.request_id

    async def late_answer_handled() -> bool:  # (its late hook ran when it came)
        return not leases._pending

    await eventually(late_answer_handled)
    assert slow._shared is not None and not slow._shared.releases  # none sent, none on its way
    assert slow.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 0

    async def first_freed() -> bool:  # replaced unclaimed: D's sidecar released it through P
        return first not in d.engine.snapshot()["held_requests"]

    await eventually(first_freed)
    d_sidecar = stack.sidecar(d).metrics.registry
    assert d_sidecar.get_sample_value("kvferry_sidecar_replaced_releases_total", {"outcome": "released"}) == 1
    assert len(d.engine.snapshot()["held_requests"]) == 1  # turn two's, for turn three

    third = {**body, "messages": next_turn(second["messages"], two.text, "And then? ")}
    three = await ask(http, router.url, third)
    assert three.decision == "PULL" and three.reused > len(one.text)
    assert three.text == await reference(CHAT, third)


async def test_a_lost_lease_stream_is_set_up_again_in_the_background() -> None:
    """While the breaker holds lookups back, a new stream is set up (a peek), so the first
    lookup after it does not wait on the set-up, where a claim can arrive too late."""
    from router.daemon_client import DaemonClient
    from router.settings import DaemonSettings

    cp = DaemonClient([f"127.0.0.1:{free_port()}"], DaemonSettings(rpc_timeout_s=0.2))
    prompt: asyncio.Future[tuple[list[int], bytes] | None] = asyncio.get_running_loop().create_future()
    prompt.set_result(([1] * 32, b""))
    reuse = await cp.lookup_early("t", "c", prompt)  # no daemon there: the stream is lost
    assert reuse.decision == "SKIPPED" and reuse.reason == "daemon_unavailable"
    assert cp._reopening is not None
    await cp.close()

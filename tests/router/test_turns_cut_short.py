"""Turns cut short: the client hangs up, or the router stops mid-turn. What the daemon
claimed for the turn is still released through P, so D does not hold it to its TTL."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from controlplane.daemon import Daemon
from router import Router
from router.choice import worth_scoring
from tests.polling import eventually
from tests.router.conftest import MakeStack, Stack
from tests.router.fakes import HI_C, fakes_with_a_lease, on_fakes
from tests.router.helpers import CHAT, COMPLETIONS, ask, first_turn, next_turn


async def _first_turn_held(
    stack: Stack, router: Router, http: aiohttp.ClientSession, topic: str, conversation: str
) -> tuple[dict[str, Any], str]:
    """A first turn of `conversation` through `router`, answered and registered. -> the
    body of its second turn, and the request D holds the first turn's blocks for."""
    [d] = stack.decodes
    body = {"messages": first_turn(topic, size=30), "max_tokens": 8, "conversation_id": conversation}
    one = await ask(http, router.url, body)
    assert one.status == 200
    await stack.registrations_idle()
    [held] = d.engine.snapshot()["held_requests"]
    return {**body, "messages": next_turn(body["messages"], one.text)}, held


def _freed(stack: Stack, held: str) -> bool:
    """Whether the decode node has freed the blocks it held for request `held`."""
    [d] = stack.decodes
    return held not in d.engine.snapshot()["held_requests"]


async def test_a_client_gone_after_its_lookup_answered_has_ds_blocks_freed(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """The client leaves after the lookup claimed D's blocks for its turn, while the router
    still waits for the prefill scores: no P request will carry the params, so the router
    has P tell D to free them. They were dropped: D held them to its TTL."""
    from tests.router.test_prefill_choice import indexed

    stack = await make_stack(prefill=2, p_config={"enable_prefix_caching": True, "kv_events_port": 0})
    router = await stack.router()
    second, held = await _first_turn_held(stack, router, http, "departures", "gone")
    for p in stack.prefills:
        if p.engine.metrics.total("vllm:prompt_tokens"):
            await indexed(stack, p, 0)
    directory = router.directory
    assert directory is not None and router.daemon is not None

    async def will_score() -> bool:  # the router's node list shows the index
        return worth_scoring(directory.nodes)

    await eventually(will_score)
    control = router.daemon
    score, lookup_early = control.score, control.lookup_early
    scoring, answered = asyncio.Event(), asyncio.Event()

    async def slow_score(hashes: Any) -> dict[str, int]:
        scoring.set()
        await asyncio.sleep(10)
        return await score(hashes)

    async def lookup(*args: Any, **kwargs: Any) -> Any:
        try:
            return await lookup_early(*args, **kwargs)
        finally:
            answered.set()

    control.score, control.lookup_early = slow_score, lookup  # type: ignore[method-assign]
    request = asyncio.create_task(http.post(router.url + CHAT, json=second))
    async with asyncio.timeout(10):
        await scoring.wait()
        await answered.wait()  # the lookup has its answer (in time), the score is still out
    await asyncio.sleep(0.05)
    request.cancel()  # the client hangs up
    with contextlib.suppress(asyncio.CancelledError):
        await request

    await eventually(lambda: _freed(stack, held))
    assert router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1


async def test_a_client_gone_while_p_has_the_params_has_them_released(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """The client hangs up while P works on the turn with D's params (queued, or reading):
    P's request is aborted, and an aborted read tells D nothing. A release through P
    does; none was sent, and D held the blocks to its TTL."""
    async with fakes_with_a_lease(daemon) as (p, d, _):  # (the lease has no digests: a release)
        p.answers = [0]  # P holds the turn until the router hangs up
        async with Router(on_fakes(daemon, p, d)) as router:
            request = asyncio.create_task(http.post(router.url + CHAT, json=HI_C))

            async def p_has_it() -> bool:
                return any(path == CHAT for path, _, _ in p.requests)

            await eventually(p_has_it)
            request.cancel()  # the client hangs up
            with contextlib.suppress(asyncio.CancelledError):
                await request

            async def released() -> bool:
                return router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1

            await eventually(released)
    [(_, _, release)] = [(path, h, body) for path, h, body in p.requests if path == COMPLETIONS]
    kv = release["kv_transfer_params"]
    assert kv["remote_request_id"] == "req-1" and kv["remote_num_tokens"] == 0
    assert d.requests == []


async def _stopped_during_a_turn(
    router: Router, http: aiohttp.ClientSession, at: Callable[[], Awaitable[bool]]
) -> None:
    """Send a turn of conversation "c", and stop the router once `at` holds."""
    try:
        request = asyncio.create_task(http.post(router.url + CHAT, json=HI_C))
        await eventually(at)
    finally:
        await router.stop()
    with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
        (await request).release()


async def test_a_stop_cutting_a_turn_short_still_sends_its_release(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """The grace runs out while P holds a turn with D's params: the turn is cut, and its
    release gets a moment of its own (it was given what was left of the grace: nothing)."""
    async with fakes_with_a_lease(daemon) as (p, d, _):
        p.answers = [0]  # P holds the turn until the router hangs up
        router = Router(on_fakes(daemon, p, d, server__shutdown_grace_s=0.2))
        await router.start()

        async def p_has_it() -> bool:
            return any(path == CHAT for path, _, _ in p.requests)

        await _stopped_during_a_turn(router, http, p_has_it)
        assert router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1
    assert COMPLETIONS in [path for path, _, _ in p.requests]


class _SlowReads:
    """A Leases/Stream call whose answers take `delay_s` to come (a slow daemon)."""

    def __init__(self, call: Any, delay_s: float) -> None:
        self._call, self._delay = call, delay_s

    async def read(self) -> Any:
        batch = await self._call.read()
        await asyncio.sleep(self._delay)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


async def test_a_stop_waits_for_the_lookups_owed_an_answer_and_releases_their_claims(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """The grace runs out while a turn waits for its lookup, which the daemon answers after
    the turn was cut: the stop waits for that answer (it hands back what the daemon
    claimed), and its release, before it closes the stream (which dropped the answer:
    D held the blocks to its TTL)."""
    async with fakes_with_a_lease(daemon) as (p, d, _):
        router = Router(on_fakes(daemon, p, d, server__shutdown_grace_s=0.2, daemon__lookup_deadline_s=2.5))
        await router.start()
        assert router.daemon is not None
        leases = router.daemon._replica.stream
        await leases.close()  # (the stream opened at start) the next one answers slowly
        real = leases._opener
        leases._opener = lambda: _SlowReads(real(), 0.6)

        async def lookup_left() -> bool:
            return bool(leases._written)

        await _stopped_during_a_turn(router, http, lookup_left)
        assert router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1
    [(_, _, release)] = [(path, h, body) for path, h, body in p.requests if path == COMPLETIONS]
    assert release["kv_transfer_params"]["remote_request_id"] == "req-1"


async def test_a_prompt_that_breaks_with_the_lookup_out_has_its_claim_released(
    make_stack: MakeStack, http: aiohttp.ClientSession, monkeypatch: Any
) -> None:
    """Making the prompt fails in a way nobody planned for while the lookup is out: the
    turn fails, and what the daemon claimed for it is released through P. The lookup went
    on without a reader: its release was never sent, D held the blocks to its TTL. (The
    same path serves a client gone just as the prompt was made.)"""
    import router.prepare

    stack = await make_stack()
    router_ = await stack.router()
    second, held = await _first_turn_held(stack, router_, http, "breakage", "broke")

    async def broken_prompt(*args: Any) -> Any:
        await asyncio.sleep(0.05)  # (the lookup leaves meanwhile)
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(router.prepare, "_prompt", broken_prompt)
    two = await ask(http, router_.url, second)
    assert two.status >= 500

    await eventually(lambda: _freed(stack, held), within=30)
    assert router_.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1

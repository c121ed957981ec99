"""Nodes the router cannot connect to: turns fail over to like nodes, keep their reuse,
never retry on a node they could not reach, and leave such a node out for a while."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp

from controlplane.daemon import Daemon
from realvllm.process import free_port
from router import Router
from sidecar import Sidecar
from tests.polling import eventually
from tests.router.conftest import MakeStack, Reference, router_settings, sidecar_for
from tests.router.fakes import behind_first, fake_engine
from tests.router.helpers import CHAT, ask, first_turn, next_turn


async def test_an_unreachable_p_does_not_cost_the_turn_its_reuse(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """The chosen P cannot be connected to: another P of the same model tokenizes, the
    daemon's params go with the prefill to it, and the turn still pulls."""
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("detours")
    one = await ask(http, router.url, {"messages": messages, "max_tokens": 30, "conversation_id": "u"})
    await stack.registrations_idle()
    body = {"messages": next_turn(messages, one.text), "max_tokens": 30}
    async with Router(behind_first(stack, f"http://127.0.0.1:{free_port()}")) as detour:
        two = await ask(http, detour.url, {**body, "conversation_id": "u", "stream": True})
        assert two.status == 200, two.body
        assert two.decision == "PULL", (two.decision, two.reason)
        assert two.text == await reference(CHAT, body)
        # The P that tokenized prefills too: no second attempt on the dead one.
        assert (
            detour.metrics.value("kvferry_router_upstream_errors_total", role="tokenize", kind="connect") == 1
        )
        assert detour.metrics.value("kvferry_router_prefill_retries_total", how="other_node") == 0


async def test_unreachable_engines(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    await stack.wait_nodes()
    [p], [d] = stack.prefills, stack.decodes
    p_url, d_url = stack.sidecar(p).url, stack.sidecar(d).url
    dead = f"http://127.0.0.1:{free_port()}"
    body = {"messages": first_turn("dead ends"), "max_tokens": 10}

    # A dead P among live ones: each request still succeeds, on the live P.
    spare = Router(
        router_settings(
            None, nodes__prefill_urls=(dead, p_url), nodes__decode_urls=(d_url,), nodes__model="m"
        )
    )
    async with spare:
        for _ in range(3):
            res = await ask(http, spare.url, body)
            assert res.status == 200 and res.text == await reference(CHAT, body)
        assert spare.metrics.value("kvferry_router_prefill_retries_total", how="other_node") >= 1

    # A dead D among live ones: D never saw the request, so another D serves it.
    spare_d = Router(
        router_settings(
            None, nodes__prefill_urls=(p_url,), nodes__decode_urls=(dead, d_url), nodes__model="m"
        )
    )
    async with spare_d:
        for _ in range(3):
            res = await ask(http, spare_d.url, {**body, "stream": True})
            assert res.status == 200 and res.text == await reference(CHAT, body)

    # A live sidecar in front of a dead engine: its 502 says the engine never saw the request,
    # so the router fails over as for a dead node (P and D alike).
    base = sidecar_for(p, stack.daemon, "prefill")
    orphan = Sidecar(replace(base, engine=replace(base.engine, url=dead, engine_id="orphan")))
    await orphan.start()
    try:
        for prefills, decodes in (((orphan.url, p_url), (d_url,)), ((p_url,), (orphan.url, d_url))):
            r = Router(
                router_settings(
                    None, nodes__prefill_urls=prefills, nodes__decode_urls=decodes, nodes__model="m"
                )
            )
            async with r:
                for _ in range(3):
                    res = await ask(http, r.url, {**body, "stream": True})
                    assert res.status == 200 and res.text == await reference(CHAT, body)
    finally:
        await orphan.stop()

    # A dead D alone: a 502 JSON error, not a hang or a traceback.
    no_d = Router(
        router_settings(None, nodes__prefill_urls=(p_url,), nodes__decode_urls=(dead,), nodes__model="m")
    )
    async with no_d:
        res = await ask(http, no_d.url, {**body, "stream": True})
        assert res.status == 502
        assert res.body["error"]["type"] == "BadGatewayError" and "decode" in res.body["error"]["message"]


async def test_a_prefill_retry_never_goes_to_a_node_the_turn_could_not_reach(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """Tokenizing found the first P dead (a like P tokenized), then that P's prefill could not
    be delivered: the one retry goes to the third P, not back to the dead one (the client
    got a 502 while a healthy P was there)."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with fake_engine() as p1, fake_engine() as p2, fake_engine() as d:
        p1.answers = [-1]  # its sidecar: "never delivered"
        settings = router_settings(
            daemon,
            nodes__prefill_urls=(dead, p1.url, p2.url),
            nodes__decode_urls=(d.url,),
            nodes__model="fake",
        )
        async with Router(settings) as router:
            body = {"messages": [{"role": "user", "content": "hi"}], "conversation_id": "fresh"}
            async with http.post(router.url + CHAT, json=body) as r:
                assert r.status == 200, await r.text()
    assert [path for path, _, _ in p1.requests] == ["/tokenize", CHAT]
    assert [path for path, _, _ in p2.requests] == [CHAT]


async def test_a_node_that_cannot_be_connected_to_is_left_out_for_a_while(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """A dead D has nothing outstanding, so the least loaded choice kept picking it (every
    other turn, ties rotating) until the node list dropped it. Now one turn pays its failed
    connect; the next ones leave it out."""
    stack = await make_stack()
    await stack.wait_nodes()
    [p], [d] = stack.prefills, stack.decodes
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused
    router = Router(
        router_settings(
            None, nodes__prefill_urls=(stack.sidecar(p).url,), nodes__decode_urls=(dead, stack.sidecar(d).url)
        )
    )
    async with router:
        body = {"messages": first_turn("dead ends"), "max_tokens": 4}
        truth = await reference(CHAT, body)
        for _ in range(6):
            res = await ask(http, router.url, body)
            assert res.status == 200 and res.text == truth
        failed = router.metrics.value("kvferry_router_upstream_errors_total", role="decode", kind="connect")
        assert failed <= 1


async def test_a_node_left_out_lately_is_still_a_retry_when_the_chosen_one_fails(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """Leaving lately unreachable nodes out is a preference: P2, left out though it is back,
    still takes the retry when the P chosen instead cannot be reached (a 502 otherwise)."""
    stack = await make_stack()
    await stack.wait_nodes()
    [p], [d] = stack.prefills, stack.decodes
    dead = f"http://127.0.0.1:{free_port()}"
    live = stack.sidecar(p).url
    router = Router(
        router_settings(None, nodes__prefill_urls=(dead, live), nodes__decode_urls=(stack.sidecar(d).url,))
    )
    async with router:
        assert router._shared is not None
        [back] = [n.engine_id for n in router._shared.directory.nodes if n.url == live]
        router._shared.load.unreachable(back, time.monotonic())
        body = {"messages": first_turn("second chances"), "max_tokens": 4}
        res = await ask(http, router.url, body)
        assert res.status == 200 and res.text == await reference(CHAT, body)


def test_nodes_left_out_come_back_after_a_pause_that_doubles() -> None:
    from router.nodes import Load

    load = Load(down_base_s=2.0, down_max_s=5.0)
    load.unreachable("n", 100.0)
    load.unreachable("n", 101.0)  # a turn that chose it before: the pause stays as it is
    assert load.down(101.9) == {"n"} and load.down(102.1) == set()
    load.unreachable("n", 102.1)  # tried again, unreachable still: 4 s
    assert load.down(106.0) == {"n"} and load.down(106.2) == set()
    load.unreachable("n", 106.2)
    assert load.down(111.1) == {"n"} and load.down(111.3) == set()  # (at most 5 s)
    load.reached("n")
    load.unreachable("n", 200.0)  # reached between: 2 s again
    assert load.down(202.1) == set()
    load.unreachable("gone", 300.0)
    assert load.down(310.0) == set() and "gone" not in load._down  # (forgotten, long past)


async def test_decode_is_counted_from_its_choice_not_from_its_request(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """D is chosen when the turn starts but asked only after the prefill: counted only then,
    every turn arriving meanwhile saw it idle and piled onto it too."""
    stack = await make_stack(decode=2, p_config={"prefill_ms_per_token": 2.0})
    router = await stack.router()
    assert router._shared is not None
    view = router._shared.load.view
    decodes = {n.engine_id for n in router._shared.directory.nodes if n.role == "decode"}
    prefills = {n.engine_id for n in router._shared.directory.nodes if n.role == "prefill"}
    turn = asyncio.ensure_future(ask(http, router.url, {"messages": first_turn("counted"), "max_tokens": 2}))

    async def prefilling() -> bool:
        return any(view.get(p, 0) for p in prefills)

    await eventually(prefilling)
    assert sum(view.get(d, 0) for d in decodes) == 1  # taken while P works
    assert (await turn).status == 200
    assert not any(view.values())  # (and given back)

"""What clients get when something goes wrong: their own mistakes, engine errors, a failed
pull, unreachable engines, a daemon that is gone or late, a D that breaks off."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from controlplane.daemon import Daemon
from emulator.sidechannel import ReadBlocks, SideChannelError
from kvferry.turnheaders import NOT_DELIVERED_HEADER
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2_grpc
from router import Router
from router import Settings as RouterSettings
from router.choice import worth_scoring
from sidecar import Sidecar
from tests.conftest import free_port, serve_app
from tests.factories import lease_request, node_request
from tests.polling import eventually
from tests.router.conftest import MakeStack, Stack, one_turn_held, router_settings, sidecar_for
from tests.router.helpers import CHAT, COMPLETIONS, ask, first_turn, next_turn, unheld_reads

Reference = Callable[[str, dict[str, Any]], Awaitable[str]]


async def test_bad_client_input_gets_vllms_400(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    stack = await make_stack()
    router = await stack.router()
    cases: list[tuple[str, bytes]] = [
        (CHAT, b"{not json"),
        (CHAT, b"[1, 2]"),
        (CHAT, b'{"model": "m"}'),
        (CHAT, b'{"messages": []}'),
        (CHAT, b'{"messages": ["hi"]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}'),
        ("/v1/completions", b'{"max_tokens": 3}'),
        (CHAT, b""),
        # 2 KB nested deeper than the JSON decoder recurses (RecursionError, not a DecodeError)
        (CHAT, b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}]}"),
    ]
    for path, raw in cases:
        async with http.post(router.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, raw
            err = (await r.json())["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"], raw
    assert router.metrics.value("kvferry_router_requests_total", endpoint=CHAT, status="400") == 8
    # aiohttp's own answers are JSON errors too, and a made-up path makes no metric label of its own.
    async with http.get(router.url + CHAT) as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]
        assert (await r.json())["error"]["code"] == 405
    async with http.post(router.url + "/v1/made-up", json={}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
    assert router.metrics.value("kvferry_router_requests_total", endpoint="unmatched", status="404") == 1


async def test_flags_vllm_reads_leniently_are_taken(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """vLLM's request models read booleans as pydantic does in lax mode: "true", 1, "off"..."""
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("lax")
    truth = await ask(http, router.url, {"messages": messages, "stream": True})
    assert truth.status == 200 and truth.events
    for given in ("true", "Yes", 1, "on"):
        res = await ask(
            http, router.url, {"messages": messages, "stream": given, "conversation_id": f"l{given}"}
        )
        assert res.status == 200 and res.events and res.text == truth.text, given
        assert res.headers["X-Kvferry-Reuse"] == "RECOMPUTE", given  # a conversation turn, looked up
    for given in ("false", "OFF", 0, 0.0):
        res = await ask(http, router.url, {"messages": messages, "stream": given})
        assert res.status == 200 and not res.events and res.text == truth.text, given
    # A completion's echo given as a string is read as vLLM reads it: "false" echoes nothing.
    res = await ask(http, router.url, {"prompt": "hello", "max_tokens": 3, "echo": "false"}, path=COMPLETIONS)
    plain = await ask(http, router.url, {"prompt": "hello", "max_tokens": 3}, path=COMPLETIONS)
    assert res.status == 200 and res.text == plain.text


async def test_engine_client_errors_pass_through(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    stack = await make_stack()
    router = await stack.router()
    messages = first_turn("errors")
    wrong_model = await ask(http, router.url, {"model": "nope", "messages": messages, "conversation_id": "e"})
    assert wrong_model.status == 404
    assert wrong_model.body["error"]["type"] == "NotFoundError"
    assert "nope" in wrong_model.body["error"]["message"]
    too_long = await ask(http, router.url, {"messages": messages, "max_tokens": 10**6, "stream": True})
    assert too_long.status == 400 and "maximum context length" in too_long.body["error"]["message"]
    bad_ids = {"prompt": [1, -5, 2**40], "max_tokens": 3, "session_id": "s"}
    res = await ask(http, router.url, bad_ids, path="/v1/completions")
    assert res.status == 400 and res.body["error"]["type"] == "BadRequestError"


async def test_a_turn_d_refuses_frees_what_p_kept_for_it(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """P keeps the prompt's blocks for D to pull (vLLM 0.32: its kv_lease_duration, 30 s;
    480 s before). A request only D refuses (P is asked for one token: an answer too long
    for the context passes there) leaves nothing to pull them, so the router has D release
    them, in a request D refuses before admission: D keeps nothing for it either."""
    stack = await make_stack()
    router = await stack.router()
    [p], [d] = stack.prefills, stack.decodes
    turns = [
        {"messages": first_turn("leaks"), "max_tokens": 10**6, "conversation_id": "leak"},
        {"messages": first_turn("leaks"), "max_tokens": 10**6, "stream": True},  # no tokens known
        {"prompt": "x" * 100, "max_tokens": 10**6},
    ]

    for n, body in enumerate(turns, 1):
        path = CHAT if "messages" in body else COMPLETIONS
        res = await ask(http, router.url, body, path=path)
        assert res.status == 400 and "maximum context length" in res.body["error"]["message"]

        async def released(n: int = n) -> bool:  # P is told before D's answer reaches the router
            done = router.metrics.value("kvferry_router_prefill_releases_total", outcome="released")
            return done == n and not p.engine.snapshot()["held_requests"]

        await eventually(released)
    # The release was refused before admission (kvferry.releases): D allocated nothing, so
    # nothing is held anywhere (the old one-token release pinned a block on D for its TTL).
    assert d.engine.snapshot()["held_requests"] == {}
    assert d.engine.metrics.total("kvferry_emulator:kv_pulled_tokens") == 0


def behind_first(stack: Stack, first_p: str) -> RouterSettings:
    """A router on the stack's daemon, its P and D as static nodes, with `first_p` listed
    (and so chosen) before the live P."""
    [p], [d] = stack.prefills, stack.decodes
    return router_settings(
        stack.daemon,
        nodes__prefill_urls=(first_p, stack.sidecar(p).url),
        nodes__decode_urls=(stack.sidecar(d).url,),
        nodes__model=p.config.model,
    )


async def test_a_streamed_turn_whose_decode_fails_to_load_is_relayed_and_counted(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """D's pull from P fails: vLLM (and the emulator) end D's stream, begun already, with an
    error event. The client gets it as D sent it; the router counts a decode error and no
    completed answer."""
    stack = await make_stack()
    router = await stack.router()
    [p] = stack.prefills

    def refuse(request: ReadBlocks) -> bytes:
        raise SideChannelError("transfer failed")

    p.engine._holds.read_blocks = refuse  # type: ignore[method-assign]
    res = await ask(http, router.url, {"messages": first_turn("streams"), "max_tokens": 5, "stream": True})
    assert res.status == 200 and res.text == "" and res.events[-1] == "[DONE]"
    assert res.events[-2]["error"]["code"] == 500 and "KV load failed" in res.events[-2]["error"]["message"]
    errors = router.metrics.value("kvferry_router_upstream_errors_total", role="decode", kind="status_5xx")
    assert errors == 1
    assert router.metrics.value("kvferry_router_request_seconds_count", reuse="none") == 0


async def test_a_failed_pull_is_retried_without_params_and_answers_right(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    router = await stack.router()
    [d] = stack.decodes
    messages = first_turn("retries")
    one = await ask(http, router.url, {"messages": messages, "max_tokens": 30, "conversation_id": "r"})
    await stack.registrations_idle()

    # The transfer fails (a NIXL error): D's side channel refuses the read.
    def refuse(request: ReadBlocks) -> bytes:
        raise SideChannelError("transfer failed")

    d.engine._holds.read_blocks = refuse  # type: ignore[method-assign]

    body = {"messages": next_turn(messages, one.text), "max_tokens": 30}
    # (not streamed: the retention turn three looks up is D's answer to this one, and
    # vLLM 0.32's streams carry no params)
    two = await ask(http, router.url, {**body, "conversation_id": "r"})
    assert two.status == 200, two.body
    assert (two.decision, two.reason) == ("RECOMPUTE", "prefill_failed")
    assert two.text == await reference(CHAT, body)
    assert router.metrics.value("kvferry_router_prefill_retries_total", how="fresh") == 1
    assert (
        router.metrics.value("kvferry_router_upstream_errors_total", role="prefill", kind="status_5xx") == 1
    )

    # The same, behind a P whose engine cannot be reached (its sidecar says the request was
    # never delivered; it still tokenizes): the params move to the live P, spending no retry,
    # that P's pull fails, and the turn is still retried without them.
    three_body = {"messages": next_turn(body["messages"], two.text), "max_tokens": 30}
    [p] = stack.prefills
    await stack.registrations_idle()

    async def tokenize_only(request: web.Request) -> web.Response:
        if request.path == "/tokenize":
            async with http.post(p.http_url + "/tokenize", data=await request.read()) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        return web.json_response(
            {"error": "engine unreachable"}, status=502, headers={NOT_DELIVERED_HEADER: "1"}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", tokenize_only)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gone = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with Router(behind_first(stack, gone)) as behind:
        three = await ask(http, behind.url, {**three_body, "conversation_id": "r", "stream": True})
        assert three.status == 200, three.body
        assert (three.decision, three.reason) == ("RECOMPUTE", "prefill_failed")
        assert three.text == await reference(CHAT, three_body)
        retries = {
            h: behind.metrics.value("kvferry_router_prefill_retries_total", how=h)
            for h in ("other_node", "fresh")
        }
        assert retries == {"other_node": 1, "fresh": 1}, retries
    await runner.cleanup()


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


async def test_a_client_gone_after_its_lookup_answered_has_ds_blocks_freed(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """The client leaves after the lookup claimed D's blocks for its turn, while the router
    still waits for the prefill scores: no P request will carry the params, so the router
    has P tell D to free them. They were dropped: D held them to its TTL."""
    from tests.router.test_prefill_choice import indexed

    stack = await make_stack(prefill=2, p_config={"enable_prefix_caching": True, "kv_events_port": 0})
    router = await stack.router()
    [d] = stack.decodes
    body = {"messages": first_turn("departures", size=30), "max_tokens": 8, "conversation_id": "gone"}
    one = await ask(http, router.url, body)
    assert one.status == 200
    await stack.registrations_idle()
    [held] = d.engine.snapshot()["held_requests"]
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
    second = {**body, "messages": next_turn(body["messages"], one.text)}
    request = asyncio.create_task(http.post(router.url + CHAT, json=second))
    async with asyncio.timeout(10):
        await scoring.wait()
        await answered.wait()  # the lookup has its answer (in time), the score is still out
    await asyncio.sleep(0.05)
    request.cancel()  # the client hangs up
    with contextlib.suppress(asyncio.CancelledError):
        await request

    async def freed() -> bool:
        return held not in d.engine.snapshot()["held_requests"]

    await eventually(freed)
    assert router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1


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
    real = leases._stub
    gate = asyncio.Event()
    leases._stub = type("Stub", (), {"Stream": lambda self: _SlowWrites(real.Stream(), gate)})()
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


# -- what the engines receive: a fake engine that records every request ------------------------


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


class FakeEngine:
    """Answers like vLLM P and D, records requests; `break_after` events cuts D's stream,
    `stall_after` events leaves it open and silent."""

    def __init__(self, break_after: int | None = None, stall_after: int | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.break_after = break_after
        self.stall_after = stall_after
        self.url = ""
        self.tokenize_fails = False
        self.model = "fake"
        self.models_status = 200
        self.models_auth: list[str] = []
        self.version = ""
        """What its GET /version reports ("" = no such route: 404)."""
        self.answers: list[int] = []
        """Statuses the next generation requests get, in turn (0: no answer until the peer
        hangs up, -1: a sidecar's "never delivered" 502); then the usual answers (a release,
        a streamed beam search, gets vLLM's 400: `kvferry.releases`)."""

    async def tokenize(self, request: web.Request) -> web.Response:
        self.requests.append(("/tokenize", _lower(request.headers), await request.json()))
        if self.tokenize_fails:
            return web.json_response({"error": "cannot"}, status=500)
        return web.json_response({"count": 40, "max_model_len": 4096, "tokens": list(range(40))})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, _lower(request.headers), body))
        status = self.answers.pop(0) if self.answers else 200
        beam_stream = body.get("stream") and body.get("use_beam_search")
        if status == 200 and request.path == COMPLETIONS and beam_stream:
            # vLLM's first check of a completion: a release is refused before admission
            message = "Streaming is not currently supported with beam search"
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        if status == 0:
            while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            return web.Response()
        if status == -1:  # what a sidecar answers for a request its engine never got
            error = {"message": "engine unreachable", "type": "BadGateway", "param": None, "code": 502}
            return web.json_response({"error": error}, status=502, headers={NOT_DELIVERED_HEADER: "1"})
        if status != 200:
            error = {"message": "refused", "type": "BadRequestError", "param": None, "code": status}
            return web.json_response({"error": error}, status=status)
        if not body.get("stream"):
            params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1]]}
            return web.json_response(
                {"id": "x", "object": "chat.completion", "choices": [], "kv_transfer_params": params}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            if self.break_after is not None and i == self.break_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == self.stall_after:  # silent until the router gives up and hangs up
                while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)  # (aiohttp sets no event when the peer hangs up)
                return resp
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def show_version(self, request: web.Request) -> web.Response:
        if not self.version:
            raise web.HTTPNotFound()
        return web.json_response({"version": self.version})

    async def models(self, request: web.Request) -> web.Response:
        self.models_auth.append(request.headers.get("Authorization", ""))
        if self.models_status != 200:
            return web.json_response({"error": "no"}, status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": self.model, "parent": None}]})


@contextlib.asynccontextmanager
async def fake_engine(
    break_after: int | None = None, stall_after: int | None = None
) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(break_after, stall_after)
    app = web.Application()
    app.router.add_post("/tokenize", fake.tokenize)
    app.router.add_post("/v1/chat/completions", fake.generate)
    app.router.add_post("/v1/completions", fake.generate)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/version", fake.show_version)
    async with serve_app(app) as fake.url:
        yield fake


def on_fakes(daemon: Daemon, p: FakeEngine, d: FakeEngine, **changes: Any) -> RouterSettings:
    """A router's settings with `p` and `d` as its nodes (given: not discovered)."""
    return router_settings(daemon, nodes__prefill_urls=(p.url,), nodes__decode_urls=(d.url,), **changes)


HI_C = {"messages": [{"role": "user", "content": "hi"}], "conversation_id": "c"}
"""A turn of conversation "c" (the one `fakes_with_a_lease` holds a retention for)."""


@contextlib.asynccontextmanager
async def fakes_with_a_lease(
    daemon: Daemon,
) -> AsyncIterator[tuple[FakeEngine, FakeEngine, leases_pb2_grpc.LeasesStub]]:
    """A fake P and D, and a retention of conversation "c" on node d-1 (no digests)."""
    async with fake_engine() as p, fake_engine() as d, grpc.aio.insecure_channel(daemon.address) as ch:
        leases = leases_pb2_grpc.LeasesStub(ch)
        await nodes_pb2_grpc.NodesStub(ch).Register(node_request("d-1"))
        await leases.Register(lease_request("c"))
        yield p, d, leases


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


async def test_several_answers_or_prompts_go_to_d_alone_without_params(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """P's params cover one sequence: a batch or n > 1 through P/D would hand D one prompt's
    blocks for all of them; no token ids describe a prompt given as embeddings. Those
    requests are D's alone, and claim no retention."""
    async with fakes_with_a_lease(daemon) as (p, d, leases):
        async with Router(on_fakes(daemon, p, d)) as router:
            chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "conversation_id": "c"}
            batch = {"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_prefill": True}}
            embeds = {"prompt_embeds": "AAAA", "conversation_id": "c"}
            cases = (
                (CHAT, chat, ("SKIPPED", "multiple_sequences")),
                ("/v1/completions", batch, (None, None)),
                ("/v1/completions", embeds, ("SKIPPED", "prompt_embeds")),
            )
            for path, body, told in cases:
                async with http.post(router.url + path, json={**body, "stream": True}) as r:
                    assert r.status == 200 and b"t4" in await r.read()
                    reuse = r.headers.get("X-Kvferry-Reuse"), r.headers.get("X-Kvferry-Reuse-Reason")
                    assert reuse == told
            value = router.metrics.value
            assert value("kvferry_router_lookups_total", decision="SKIPPED", reason="multiple_sequences") == 1
            assert value("kvferry_router_lookups_total", decision="SKIPPED", reason="prompt_embeds") == 1
        peek = await leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_tokens=10, peek=True))
        assert peek.reason not in ("already_claimed", "no_lease")  # still there, unclaimed
    assert p.requests == []
    [(_, d_headers, d_chat), (_, _, d_batch), (_, _, d_embeds)] = d.requests
    assert d_embeds["prompt_embeds"] == "AAAA" and "kv_transfer_params" not in d_embeds
    assert d_chat["n"] == 2 and "kv_transfer_params" not in d_chat and "conversation_id" not in d_chat
    assert "x-conversation-id" not in d_headers  # D retains nothing of it: its sidecar need not look
    assert d_batch["prompt"] == ["a", "b"] and "kv_transfer_params" not in d_batch


async def test_params_a_p_never_got_still_go_with_the_fresh_retry(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """The only P could not be reached with the daemon's params (never delivered) and the
    turn is tried again without reuse: the retry still hands P D's params, with nothing
    to pull, so D frees the claimed blocks now. They were dropped: D held them to its TTL."""
    async with fakes_with_a_lease(daemon) as (p, d, _):  # (the lease has no digests: a release)
        p.answers = [-1]
        async with Router(on_fakes(daemon, p, d)) as router:
            async with http.post(router.url + CHAT, json=HI_C) as r:
                assert r.status == 200, await r.text()
            assert router.metrics.value("kvferry_router_prefill_retries_total", how="fresh") == 1
    first, second = (body["kv_transfer_params"] for path, _, body in p.requests if path == CHAT)
    assert first["remote_num_tokens"] == 0 and first["remote_request_id"] == "req-1"
    assert second == first


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
        router = Router(on_fakes(daemon, p, d, server__shutdown_grace_s=0.2, daemon__lookup_deadline_s=5.0))
        await router.start()
        assert router.daemon is not None
        leases = router.daemon._replica.stream
        await leases.close()  # (the stream opened at start) the next one answers slowly
        real = leases._stub
        leases._stub = type("Stub", (), {"Stream": lambda self: _SlowReads(real.Stream(), 0.6)})()

        async def lookup_left() -> bool:
            return bool(leases._written)

        await _stopped_during_a_turn(router, http, lookup_left)
        assert router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1
    [(_, _, release)] = [(path, h, body) for path, h, body in p.requests if path == COMPLETIONS]
    assert release["kv_transfer_params"]["remote_request_id"] == "req-1"


async def test_a_release_never_goes_to_a_prefill_node_the_turn_could_not_reach(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """The chosen P cannot be connected to (tokenizing moves to a like P, and the turn with
    it), and that P fails the pull: the release goes through a P the turn reached, not
    the least loaded one of the kind, which was the dead one (the release then failed,
    and D held the blocks to its TTL)."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with fakes_with_a_lease(daemon) as (p, d, _):
        p.answers = [500, 500]
        settings = router_settings(
            daemon, nodes__prefill_urls=(dead, p.url), nodes__decode_urls=(d.url,), nodes__model="fake"
        )
        async with Router(settings) as router:
            async with http.post(router.url + CHAT, json=HI_C) as r:
                assert r.status == 502, await r.text()

            async def released() -> bool:
                return router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1

            await eventually(released)
            assert router.metrics.value("kvferry_router_claim_releases_total", outcome="failed") == 0
    paths = [path for path, _, _ in p.requests]
    assert paths[0] == "/tokenize" and COMPLETIONS in paths  # (the dead one was asked first)


@pytest.mark.parametrize("status", [400, 500])
async def test_params_p_failed_with_are_released(
    daemon: Daemon, http: aiohttp.ClientSession, status: int
) -> None:
    """P's frontend refuses the turn with a 4xx (a prompt grown past max_model_len, say), or
    its pull fails (a 5xx: vLLM's P then sends D no notification), and the retry without
    params fails too: nothing would free the blocks the daemon claimed for the turn. A
    release through P does; it was not sent (after a 5xx, not before this one)."""
    async with fakes_with_a_lease(daemon) as (p, d, _):  # (the lease has no digests: a release)
        p.answers = [status, status]
        async with Router(on_fakes(daemon, p, d)) as router:
            async with http.post(router.url + CHAT, json=HI_C) as r:
                assert r.status == (400 if status == 400 else 502), await r.text()

            async def released() -> bool:
                return router.metrics.value("kvferry_router_claim_releases_total", outcome="released") == 1

            await eventually(released)
    turn, retry = (body["kv_transfer_params"] for path, _, body in p.requests if path == CHAT)
    assert turn["remote_request_id"] == "req-1" and "remote_request_id" not in retry
    [(_, _, release)] = [(path, h, body) for path, h, body in p.requests if path == COMPLETIONS]
    kv = release["kv_transfer_params"]
    assert release["max_tokens"] == 1 and kv["remote_request_id"] == "req-1" and kv["remote_num_tokens"] == 0
    assert release["stream"] is True and release["use_beam_search"] is True  # refused: P keeps nothing
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False  # ...and notifies D
    assert d.requests == []


_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
_TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, _IMAGE]}]},
            "non_text_content",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL], "tool_choice": "none"},
            "prompt_not_reproducible",
        ),
        (  # (vLLM 0.32's Kimi K3 renderer puts these in the prompt; /tokenize has no field)
            {"messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL], "tool_choice": "required"},
            "prompt_not_reproducible",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "ls"}},
            },
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 100},
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "a", "text": "b"}]},
            "prompt_not_reproducible",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
            "prompt_not_reproducible",
        ),
    ],
)
async def test_a_prompt_the_router_cannot_verify_is_served_plain_and_claims_nothing(
    daemon: Daemon, http: aiohttp.ClientSession, fields: dict[str, Any], reason: str
) -> None:
    """Two images of one size tokenize to the same placeholder ids, so the prompt's digests
    cannot tell a turn whose image changed from one whose image did not; and /tokenize
    does not render the prompt of a request with tool_choice "none" (an engine may leave
    the tools out), truncate_prompt_tokens, documents or reasoning_effort (which its
    chat request has no field for) as the request gets it, so P and D would
    compute other token ids than the request's. Such a turn is not looked up, not
    tokenized, and leaves nothing for D's sidecar to retain."""
    async with fakes_with_a_lease(daemon) as (p, d, leases):
        async with Router(on_fakes(daemon, p, d)) as router:
            chat = {**fields, "conversation_id": "c"}
            async with http.post(router.url + CHAT, json={**chat, "stream": True}) as r:
                assert r.status == 200 and b"t4" in await r.read()
                reuse = r.headers.get("X-Kvferry-Reuse"), r.headers.get("X-Kvferry-Reuse-Reason")
                assert reuse == ("SKIPPED", reason)
            value = router.metrics.value
            assert value("kvferry_router_lookups_total", decision="SKIPPED", reason=reason) == 1
        peek = await leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", prompt_tokens=10, peek=True))
        assert peek.reason not in ("already_claimed", "no_lease")  # still there, unclaimed
    paths = [path for path, _, _ in p.requests]
    assert paths == [CHAT]  # no /tokenize
    (_, _, p_chat) = p.requests[0]
    assert p_chat["messages"] == fields["messages"]
    assert "prompt_token_ids" not in p_chat["kv_transfer_params"]
    [(_, d_headers, d_chat)] = d.requests
    assert "x-conversation-id" not in d_headers and "conversation_id" not in d_chat
    assert d_headers["x-kvferry-no-retention"] == "1"  # (a body session_id would name it still)


async def test_with_api_keys_only_their_holders_get_in(http: aiohttp.ClientSession) -> None:
    """--api-key, as vLLM's: a bearer key on /v1/ routes, 401 without one; the router's own
    endpoints stay open. Needed most with --engine-api-key, where the engines see only the
    router's key."""
    async with fake_engine() as p, fake_engine() as d:
        settings = router_settings(
            None,
            nodes__prefill_urls=(p.url,),
            nodes__decode_urls=(d.url,),
            server__api_keys=("k-one", "k-two"),
            upstream__api_key="engine-key",
        )
        async with Router(settings) as router:
            body = {"messages": [{"role": "user", "content": "hi"}]}
            for auth in (None, "Bearer k-three", "k-one", "Bearer k-on"):
                headers = {"Authorization": auth} if auth else {}
                async with http.post(router.url + CHAT, json=body, headers=headers) as r:
                    assert (r.status, await r.json()) == (401, {"error": "Unauthorized"}), auth
                async with http.get(router.url + "/v1/models", headers=headers) as r:
                    assert r.status == 401
            assert p.requests == [] and d.requests == []
            for key_two in ({"Authorization": "Bearer k-two"}, {"Authorization": "bearer k-two"}):
                async with http.post(router.url + CHAT, json=body, headers=key_two) as r:
                    assert r.status == 200
            for path in ("/health", "/metrics"):
                async with http.get(router.url + path) as r:
                    assert r.status == 200
            text = router.metrics.render()[0].decode()
            assert 'endpoint="/v1/chat/completions",status="401"} 4.0' in text
    assert [h["authorization"] for _, h, _ in d.requests] == ["Bearer engine-key"] * 2
    # (learning a static node's model asks with the engine key too: a vLLM with --api-key wants it)
    assert p.models_auth and set(p.models_auth) == {"Bearer engine-key"}


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


async def _one_decode_protocol_error(router: Router) -> None:
    """Until the router has counted exactly one broken D answer (counted once the relay ends)."""

    async def counted() -> bool:
        errors = router.metrics.value("kvferry_router_upstream_errors_total", role="decode", kind="protocol")
        return errors == 1

    await eventually(counted)


async def test_a_decode_that_breaks_off_cuts_the_clients_stream(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    async with fake_engine() as p, fake_engine(break_after=2) as d:
        settings = on_fakes(daemon, p, d)
        async with Router(settings) as router:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            received = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async with http.post(router.url + CHAT, json=body) as r:
                    assert r.status == 200
                    async for chunk in r.content.iter_any():
                        received += chunk
            assert b"t1" in received and b"[DONE]" not in received
            await _one_decode_protocol_error(router)


async def test_releases_are_counted_and_shutdown_does_not_wait_for_them(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    async with fake_engine() as p, fake_engine() as d:
        d.answers = [400, 422, 400, 0]  # turn, its release refused; turn, its release never answered
        settings = on_fakes(daemon, p, d, server__shutdown_grace_s=0.2)
        router = Router(settings)
        await router.start()
        try:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}
            for _ in range(2):
                async with http.post(router.url + CHAT, json=body) as r:
                    assert r.status == 400

            async def both_sent() -> bool:
                return len(d.requests) == 4

            await eventually(both_sent)
            path, _, release = d.requests[1]
            assert path == "/v1/completions" and release["max_tokens"] == 1 and release["prompt"] == "."
            assert release["model"] == "fake" and release["kv_transfer_params"]["remote_num_tokens"] == 0
            assert router.metrics.value("kvferry_router_prefill_releases_total", outcome="refused") == 1
        finally:
            async with asyncio.timeout(5):  # the grace, then the unanswered release is given up
                await router.stop()
        assert router.metrics.value("kvferry_router_prefill_releases_total", outcome="released") == 0


async def test_releases_in_flight_are_capped(daemon: Daemon, http: aiohttp.ClientSession) -> None:
    """A D that refuses turns and never answers their releases gathers no backlog of them."""
    async with fake_engine() as p, fake_engine() as d:
        d.answers = [400, 0, 400, 400]  # turn, its release never answered; two more turns refused
        settings = router_settings(
            daemon,
            nodes__prefill_urls=(p.url,),
            nodes__decode_urls=(d.url,),
            upstream__max_releases_in_flight=1,
            server__shutdown_grace_s=0.2,
        )
        router = Router(settings)
        await router.start()
        try:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}
            async with http.post(router.url + CHAT, json=body) as r:
                assert r.status == 400

            async def release_sent() -> bool:
                return len(d.requests) == 2

            await eventually(release_sent)
            for _ in range(2):
                async with http.post(router.url + CHAT, json=body) as r:
                    assert r.status == 400
            await asyncio.sleep(0.1)
            assert [path for path, _, _ in d.requests] == [CHAT, "/v1/completions", CHAT, CHAT]
            assert router.metrics.value("kvferry_router_prefill_releases_total", outcome="skipped") == 2
        finally:
            async with asyncio.timeout(5):
                await router.stop()


async def test_a_decode_gone_silent_is_given_up(daemon: Daemon, http: aiohttp.ClientSession) -> None:
    """A wedged D (connection open, nothing sent) does not hold the client forever."""
    async with fake_engine() as p, fake_engine(stall_after=2) as d:
        settings = router_settings(
            daemon,
            nodes__prefill_urls=(p.url,),
            nodes__decode_urls=(d.url,),
            upstream__decode_idle_timeout_s=0.5,
        )
        async with Router(settings) as router:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            received = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async with asyncio.timeout(10), http.post(router.url + CHAT, json=body) as r:
                    async for chunk in r.content.iter_any():
                        received += chunk
            assert b"t1" in received and b"[DONE]" not in received
            await _one_decode_protocol_error(router)


async def test_a_turn_whose_prompt_cannot_be_tokenized_releases_what_the_early_lookup_claimed(
    daemon: Daemon, http: aiohttp.ClientSession
) -> None:
    """The lookup leaves before tokenizing; when P then cannot tokenize, the daemon's
    answer (RECOMPUTE with release params) still reaches P, so D frees its blocks."""
    async with fake_engine() as p, fake_engine() as d:
        p.tokenize_fails = True
        async with grpc.aio.insecure_channel(daemon.address) as ch:
            await nodes_pb2_grpc.NodesStub(ch).Register(node_request("d-1"))
            await leases_pb2_grpc.LeasesStub(ch).Register(lease_request("conv-t"))
        settings = on_fakes(daemon, p, d)
        async with Router(settings) as router:
            body = {
                "model": "fake",
                "messages": [{"role": "user", "content": "hi"}],
                "conversation_id": "conv-t",
                "stream": True,
            }
            res = await ask(http, router.url, body)
            assert res.status == 200
            counted = router.metrics.registry.get_sample_value(
                "kvferry_router_lookups_total", {"decision": "SKIPPED", "reason": "no_tokens"}
            )
            assert counted == 1.0
    (_, _, p_body) = p.requests[1]  # after the refused /tokenize
    kv = p_body["kv_transfer_params"]
    assert kv["remote_num_tokens"] == 0 and kv["do_remote_decode"] is True and "prompt_token_ids" not in kv


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

"""Engines that fail a turn: D refuses it, a pull fails, P fails or cannot tokenize, D
breaks off or goes silent; what the client gets, and the releases that free what P or D
kept for the turn."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from aiohttp import web

from controlplane.daemon import Daemon
from emulator.sidechannel import ReadBlocks, SideChannelError
from kvferry.turnheaders import NOT_DELIVERED_HEADER
from kvferry.v1 import leases_pb2_grpc, nodes_pb2_grpc
from realvllm.process import free_port
from router import Router
from tests.factories import lease_request, node_request
from tests.polling import eventually
from tests.router.conftest import MakeStack, Reference, router_settings
from tests.router.fakes import HI_C, behind_first, fake_engine, fakes_with_a_lease, on_fakes
from tests.router.helpers import CHAT, COMPLETIONS, ask, first_turn, next_turn


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

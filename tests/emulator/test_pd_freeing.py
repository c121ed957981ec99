"""When P and D free the blocks a P/D turn held: on the notify, at their deadlines, on a
skipped pull or a client gone; and the reads that fail or go wrong instead (too close to
expiry, a second read, params of an engine restarted or of no prefill).

Unless a test says otherwise P has no local prefix cache, as in test_pd_flows.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from emulator import pulls as pulls_module
from emulator.sidechannel import Notify
from tests.emulator.conftest import StartEmulator
from tests.emulator.helpers import Client, async_test, conversation
from tests.emulator.pd import (
    FirstTurn,
    fully_free,
    next_turn,
    pd_turn,
    wait_until_free,
)
from tests.polling import eventually


@async_test(timeout=15)
async def test_notify_does_not_hold_up_the_answer_but_always_arrives(
    first_turn: FirstTurn, http: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d, params, second = first_turn.p, first_turn.d, first_turn.params, first_turn.second

    real_notify = pulls_module.notify_remote
    delivered, gate = asyncio.Event(), asyncio.Event()

    async def held_notify(host: str, port: int, request: Notify) -> None:
        await gate.wait()  # (the network, slow)
        await real_notify(host, port, request)
        delivered.set()

    monkeypatch.setattr(pulls_module, "notify_remote", held_notify)
    prefill = await http.prefill(p, second, params)  # answered while its notify is held up
    assert prefill.pull == "pulled" and not delivered.is_set()
    assert params["remote_request_id"] in (await http.state(d))["held_requests"]
    gate.set()
    await delivered.wait()
    assert not (await http.state(d))["held_requests"]  # D freed on the notify

    # A notify still on its way when P shuts down is delivered before P is gone.
    delivered.clear()
    gate.clear()
    assert prefill.params is not None
    third = next_turn(second, "An answer.")
    answer = await http.chat(d, second, max_tokens=64, kv_transfer_params=prefill.params)
    assert answer.pull == "pulled" and answer.params is not None
    refused = await http.prefill(p, third, {**answer.params, "remote_num_tokens": 0})
    assert refused.pull == "skipped:no_remote_tokens"
    assert not delivered.is_set()
    asyncio.get_running_loop().call_later(0.3, gate.set)
    await p.stop()
    assert delivered.is_set()
    assert not (await http.state(d))["held_requests"]


@async_test(timeout=15)
async def test_second_read_of_the_same_params_reads_freed_blocks_silently(
    first_turn: FirstTurn, http: Client
) -> None:
    """As on vLLM: D freed the blocks after the first read, and nothing stops a second one.
    It succeeds with whatever the blocks hold by then; D counts it as an unheld read (and
    logs the notify of an unknown request), which is how a test catches a double handout."""
    p, d, params, second = first_turn.p, first_turn.d, first_turn.params, first_turn.second
    assert (await http.prefill(p, second, params)).pull == "pulled"
    assert (await http.state(d))["unheld_reads"] == 0
    stale = await http.prefill(p, second, params)
    assert stale.status == 200 and stale.pull == "pulled"
    assert (await http.state(d))["unheld_reads"] == 1


@async_test(timeout=30)
async def test_reads_close_to_expiry_are_refused(start_emulator: StartEmulator, http: Client) -> None:
    strict = await start_emulator(enable_prefix_caching=False)
    lenient = await start_emulator(enable_prefix_caching=False, kv_load_failure_policy="recompute")
    d = await start_emulator(decoder_kv_blocks_ttl=4.0)  # always within 5 s of expiry
    first = conversation()
    _, decode = await pd_turn(http, strict, d, first)
    second = next_turn(first, decode.content)

    refused = await http.prefill(strict, second, decode.params)
    assert refused.status == 500
    # Refused at the read: vLLM's P tells D nothing, and D holds the blocks to its deadline.
    assert decode.params["remote_request_id"] in (await http.state(d))["held_requests"]

    # Streamed, the failed load ends a stream already begun (vLLM finishes the request with
    # an error): an error event, then the end of the stream.
    _, decode = await pd_turn(http, strict, d, first)
    assert decode.params is not None
    kv = {**decode.params, "do_remote_decode": True, "do_remote_prefill": False}
    body = {
        "messages": second,
        "max_tokens": 1,
        "stream": True,
        "return_token_ids": True,
        "kv_transfer_params": kv,
    }
    role, error, done = await http.stream(strict, "/v1/chat/completions", body)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # as ever, first
    prompt = (await http.post(strict, "/tokenize", {"messages": second})).body["tokens"]
    assert role["prompt_token_ids"] == prompt
    assert done == "[DONE]" and error["error"]["code"] == 500
    assert "KV load failed (expiry_too_close)" in error["error"]["message"]
    assert decode.params["remote_request_id"] in (await http.state(d))["held_requests"]

    _, decode = await pd_turn(http, strict, d, first)
    recomputed = await http.prefill(lenient, second, decode.params)
    assert recomputed.status == 200
    assert recomputed.pull == "recomputed:expiry_too_close"
    assert recomputed.count("pulled") == 0
    assert await wait_until_free(http, d)  # (at their deadlines, 4 s after each turn)


@async_test(timeout=15)
async def test_skipped_pulls_still_free_the_decoders_blocks(
    start_emulator: StartEmulator, http: Client
) -> None:
    cautious = await start_emulator(enable_prefix_caching=False, kv_recompute_threshold=100_000)
    caching = await start_emulator()  # prefills turn 1 itself, so it holds most of turn 2 locally
    d = await start_emulator()
    first = conversation()
    second_text = "Short. "

    _, decode = await pd_turn(http, cautious, d, first)
    skipped = await http.prefill(cautious, next_turn(first, decode.content, second_text), decode.params)
    assert skipped.pull == "skipped:below_threshold"
    assert skipped.count("computed") == skipped.body["usage"]["prompt_tokens"]
    await eventually(lambda: fully_free(http, d))

    _, decode = await pd_turn(http, caching, d, first)
    local = await http.prefill(caching, next_turn(first, decode.content, second_text), decode.params)
    assert local.pull == "skipped:below_threshold"
    assert local.count("cached") > 0
    await eventually(lambda: fully_free(http, d))

    _, decode = await pd_turn(http, cautious, d, first)
    assert decode.params is not None
    release_only = {**decode.params, "remote_num_tokens": 0}
    freed = await http.prefill(cautious, next_turn(first, decode.content), release_only)
    assert freed.pull == "skipped:no_remote_tokens"
    await eventually(lambda: fully_free(http, d))


@async_test(timeout=10)
async def test_decoder_frees_unclaimed_blocks_at_the_deadline(
    start_emulator: StartEmulator, http: Client
) -> None:
    p = await start_emulator(enable_prefix_caching=False, kv_load_failure_policy="recompute")
    d = await start_emulator(decoder_kv_blocks_ttl=1.5)  # (held still when the next line looks)
    first = conversation()
    _, decode = await pd_turn(http, p, d, first)
    assert decode.params is not None
    assert (await http.state(d))["held_requests"]
    await eventually(lambda: fully_free(http, d))
    late = await http.prefill(
        p,
        next_turn(first, decode.content),
        {**decode.params, "remote_blocks_expiry_time": time.perf_counter() + 60},
    )
    # A deadline P cannot see (not forwarded): the read of the freed blocks goes through.
    assert late.pull == "pulled" and (await http.state(d))["unheld_reads"] == 1


@async_test(timeout=15)
async def test_client_disconnect_retains_nothing(start_emulator: StartEmulator, http: Client) -> None:
    p = await start_emulator(enable_prefix_caching=False)
    d = await start_emulator(decode_ms_per_token=20)
    messages = conversation()
    prefill = await http.prefill(p, messages)
    body = {
        "messages": messages,
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": prefill.params,
    }
    async with http.session.post(d.http_url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.content.readline()
        response.close()
    await eventually(lambda: fully_free(http, d))
    assert await wait_until_free(http, p)


@async_test(timeout=10)
async def test_prefiller_frees_blocks_its_decoder_never_read(
    start_emulator: StartEmulator, http: Client
) -> None:
    p = await start_emulator(kv_abort_timeout=1.5)  # (held still when the next line looks)
    prefill = await http.prefill(p, conversation())
    assert prefill.params is not None
    assert list((await http.state(p))["held_requests"]) == [prefill.params["remote_request_id"]]
    await eventually(lambda: fully_free(http, p))


@async_test(timeout=15)
async def test_params_of_a_previous_engine_generation_fail(
    start_emulator: StartEmulator, first_turn: FirstTurn, http: Client
) -> None:
    p, d = first_turn.p, first_turn.d
    port = d.side_channel_port
    await d.stop()
    restarted = await start_emulator(side_channel_port=port)  # same address, new engine id
    assert restarted.engine_id != d.engine_id
    stale = await http.prefill(p, first_turn.second, first_turn.params)
    assert stale.status == 500


@async_test(timeout=15)
async def test_decode_side_params_without_a_prefills_pin_the_blocks_and_count_as_a_fault(
    start_emulator: StartEmulator, http: Client
) -> None:
    """vLLM takes any request with params and no do_remote_decode for a decode-side one and
    pins its blocks at the finish, but frees them (TTL, P's notification) only for one
    that came with a prefill's params: kvferry must never send such params. The emulator
    holds them to the TTL and counts the leak vLLM would have."""
    d = await start_emulator()
    faults = "kvferry_emulator:connector_faults"
    plain = await http.chat(d, conversation(), max_tokens=4)
    assert plain.params is None and d.engine.metrics.total(faults) == 0
    pinned = await http.chat(d, conversation(), max_tokens=4, kv_transfer_params={"do_remote_prefill": False})
    assert (
        pinned.params is not None
        and pinned.params["remote_request_id"] in (await http.state(d))["held_requests"]
    )
    assert d.engine.metrics.total(faults) == 1


async def test_a_d_restarted_under_its_fixed_engine_id_as_vllm_p_sees_it(
    start_emulator: StartEmulator, http: Client
) -> None:
    """vLLM's P caches its handshake per engine id and never checks it again: with D
    restarted under the same fixed engine id, a P holding a handshake of the old process
    fails the read (the agent is gone), and handshakes again next time; a P holding none
    handshakes with the new process and reads its memory at the old block ids, silently
    (counted as an unheld read by the new D). The emulator checked nothing of the kind:
    every read handshook anew."""
    from realvllm.process import free_port

    fixed = {"engine_id": "d-fixed", "side_channel_port": free_port()}
    cached = await start_emulator(enable_prefix_caching=False, kv_load_failure_policy="recompute")
    fresh = await start_emulator(enable_prefix_caching=False, kv_load_failure_policy="recompute")
    d = await start_emulator(**fixed)
    first = conversation()
    _, one = await pd_turn(http, cached, d, first)
    _, two = await pd_turn(http, cached, d, next_turn(first, one.content))
    assert one.params is not None and two.params is not None
    assert (await http.prefill(cached, next_turn(first, one.content), one.params)).pull == "pulled"

    await d.stop()
    again = await start_emulator(**fixed)
    assert again.engine_id == d.engine_id
    turn = next_turn(next_turn(first, one.content), two.content)
    failed = await http.prefill(cached, turn, two.params)
    assert failed.status == 200 and failed.pull == "recomputed:transfer_error"
    stale = await http.prefill(fresh, turn, two.params)
    assert stale.status == 200 and stale.pull == "pulled"  # wrong KV, and nobody told
    assert (await http.state(again))["unheld_reads"] == 1
    # The failed read dropped the old handshake: the next read reaches the new process.
    assert (await http.prefill(cached, turn, two.params)).pull == "pulled"
    assert (await http.state(again))["unheld_reads"] == 2

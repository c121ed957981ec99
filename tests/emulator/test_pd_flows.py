"""Prefill/decode flows over real HTTP and the real side channel.

A conversation runs through a prefiller P and a decoder D as the router drives
them. Unless a test says otherwise P has no local prefix cache, so whatever it
does not pull it must compute.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from emulator import engine as engine_module
from emulator.sidechannel import Notify
from tests.emulator.conftest import StartEmulator
from tests.emulator.helpers import Client, async_test, conversation
from tests.emulator.pd import (
    FirstTurn,
    fully_free,
    next_turn,
    not_held,
    pd_turn,
    reference_answer,
    wait_until_free,
)
from tests.polling import eventually


@async_test(timeout=15)
async def test_two_turns_pull_the_decoders_blocks(start_emulator: StartEmulator, http: Client) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    first = conversation()

    prefill, decode = await pd_turn(http, p, d, first)
    prompt_len = prefill.body["usage"]["prompt_tokens"]
    assert prefill.count("computed") == prompt_len
    assert decode.pull == "pulled" and decode.count("pulled") == prompt_len
    assert await wait_until_free(http, p)

    params = decode.params
    assert params is not None
    generated = decode.body["usage"]["completion_tokens"]
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_num_tokens"] == prompt_len + generated - 1
    assert params["remote_engine_id"] == d.engine_id
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", d.side_channel_port)
    assert len(params["remote_block_ids"]) == 1
    assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // 16)
    assert 470 < params["remote_blocks_expiry_time"] - time.perf_counter() <= 480
    assert params["transfer_mode"] == "pull" and params["tp_size"] == 1
    state = await http.state(d)
    assert list(state["held_requests"]) == [params["remote_request_id"]]

    second = next_turn(first, decode.content)
    prefill2, decode2 = await pd_turn(http, p, d, second, pull_from=params)
    assert prefill2.pull == "pulled"
    assert prefill2.count("pulled") == params["remote_num_tokens"]
    assert prefill2.count("computed") == prefill2.body["usage"]["prompt_tokens"] - params["remote_num_tokens"]
    await eventually(  # the notify travels beside P's answer, not before it
        lambda: not_held(http, d, params["remote_request_id"])
    )
    assert decode2.content == await reference_answer(start_emulator, http, second)


@async_test(timeout=15)
async def test_pull_saves_prefill_time(start_emulator: StartEmulator, http: Client) -> None:
    # (3 ms a token: a stall of a few hundred ms on a loaded machine stays far from the margin)
    p = await start_emulator(enable_prefix_caching=False, prefill_ms_per_token=3.0, transfer_ms_per_block=1.0)
    d = await start_emulator()
    first = conversation()
    _, decode = await pd_turn(http, p, d, first)
    second = next_turn(first, decode.content)

    began = time.perf_counter()
    reused = await http.prefill(p, second, decode.params)
    reused_s = time.perf_counter() - began
    began = time.perf_counter()
    recomputed = await http.prefill(p, second)
    recomputed_s = time.perf_counter() - began

    prompt_len = recomputed.count("computed")
    assert reused.count("computed") < prompt_len / 4
    assert reused_s < recomputed_s / 2
    assert recomputed_s >= 3 * prompt_len / 1000
    # The emulator's own work runs within the modeled steps, never instead of them: a pull
    # lasts at least its blocks' transfer time plus the computed tokens' prefill time.
    pulled_blocks = -(-reused.count("pulled") // 16)
    assert reused_s >= (pulled_blocks + 3 * reused.count("computed")) / 1000


@async_test(timeout=15)
async def test_notify_does_not_hold_up_the_answer_but_always_arrives(
    first_turn: FirstTurn, http: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d, params, second = first_turn.p, first_turn.d, first_turn.params, first_turn.second

    real_notify = engine_module.notify_remote
    delivered, gate = asyncio.Event(), asyncio.Event()

    async def held_notify(host: str, port: int, request: Notify) -> None:
        await gate.wait()  # (the network, slow)
        await real_notify(host, port, request)
        delivered.set()

    monkeypatch.setattr(engine_module, "notify_remote", held_notify)
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
async def test_answers_with_reuse_equal_answers_without(start_emulator: StartEmulator, http: Client) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    messages = conversation()
    params = None
    for turn in range(3):
        prefill, decode = await pd_turn(http, p, d, messages, pull_from=params)
        assert prefill.pull == ("none" if turn == 0 else "pulled")
        assert decode.content == await reference_answer(start_emulator, http, messages)
        params = decode.params
        messages = next_turn(messages, decode.content, f"Turn {turn}, continue. ")


@async_test(timeout=15)
async def test_trimmed_pull_is_right_and_an_untrimmed_one_is_wrong(
    start_emulator: StartEmulator, first_turn: FirstTurn, http: Client
) -> None:
    p, d, params, second = first_turn.p, first_turn.d, first_turn.params, first_turn.second
    reference = await reference_answer(start_emulator, http, second)

    # Cut to the leading 5 blocks the right way: token count and block list together.
    trimmed = {**params, "remote_num_tokens": 80, "remote_block_ids": [params["remote_block_ids"][0][:5]]}
    prefill = await http.prefill(p, second, trimmed)
    assert prefill.count("pulled") == 80
    answer = await http.chat(d, second, max_tokens=64, kv_transfer_params=prefill.params)
    assert answer.content == reference

    # Cut only the token count: P takes the tail of the list, KV of other positions.
    _, decode = await pd_turn(http, p, d, first_turn.first)
    assert decode.params is not None
    wrong = {**decode.params, "remote_num_tokens": 80}
    prefill = await http.prefill(p, second, wrong)
    assert prefill.count("pulled") == 80
    answer = await http.chat(d, second, max_tokens=64, kv_transfer_params=prefill.params)
    assert answer.content != reference


@async_test(timeout=15)
async def test_pull_for_a_diverged_prompt_changes_the_answer(
    start_emulator: StartEmulator, first_turn: FirstTurn, http: Client
) -> None:
    p, d = first_turn.p, first_turn.d
    # The client edited the earlier answer: P's prompt no longer begins with D's tokens.
    diverged = next_turn(first_turn.first, first_turn.decode.content.upper() + "!")
    prefill = await http.prefill(p, diverged, first_turn.params)
    assert prefill.pull == "pulled"
    answer = await http.chat(d, diverged, max_tokens=64, kv_transfer_params=prefill.params)
    assert answer.content != await reference_answer(start_emulator, http, diverged)


@async_test(timeout=15)
async def test_streams_carry_no_params_as_in_vllm_0_32(start_emulator: StartEmulator, http: Client) -> None:
    p = await start_emulator(enable_prefix_caching=False)
    d = await start_emulator()
    messages = conversation()
    prefill = await http.prefill(p, messages)
    body = {"messages": messages, "max_tokens": 16, "stream": True, "kv_transfer_params": prefill.params}
    events = await http.stream(d, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and len(events) > 2
    assert not any("kv_transfer_params" in e for e in events[:-1])
    assert d.engine.snapshot()["held_requests"]  # D keeps the blocks all the same (bidirectional)


async def test_stream_final_chunk_carries_params_with_pr_40186(
    start_emulator: StartEmulator, http: Client
) -> None:
    p = await start_emulator(enable_prefix_caching=False)
    d = await start_emulator(stream_kv_transfer_params=True)
    messages = conversation()
    prefill = await http.prefill(p, messages)
    events = await http.stream(
        d,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 64,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "kv_transfer_params": prefill.params,
        },
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        chunks[0]["prompt_token_ids"]
        == (await http.post(d, "/tokenize", {"messages": messages})).body["tokens"]
    )
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] > 0
    content = chunks[1:-1]
    final = content[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert all("kv_transfer_params" not in c for c in content[:-1])
    params = final["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["remote_engine_id"] == d.engine_id
    token_ids = [t for c in content for t in c["choices"][0]["token_ids"]]
    assert params["remote_num_tokens"] == usage["usage"]["prompt_tokens"] + len(token_ids) - 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    plain = await http.chat(d, messages, max_tokens=64)
    assert text == plain.content


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


@async_test(timeout=15)
async def test_prompt_token_ids_skip_templating(start_emulator: StartEmulator, http: Client) -> None:
    p = await start_emulator(enable_prefix_caching=False)
    d = await start_emulator()
    messages = conversation()
    tokens = await http.post(p, "/tokenize", {"messages": messages})
    ids = tokens.body["tokens"]
    prefill = await http.chat(
        p,
        [{"role": "user", "content": "ignored"}],
        max_tokens=1,
        return_token_ids=True,
        kv_transfer_params={"do_remote_decode": True, "prompt_token_ids": ids},
    )
    assert prefill.body["prompt_token_ids"] == ids
    assert prefill.params is not None and prefill.params["remote_num_tokens"] == len(ids)
    decode = await http.chat(
        d,
        [{"role": "user", "content": "also ignored"}],
        max_tokens=64,
        return_token_ids=True,
        kv_transfer_params={**prefill.params, "prompt_token_ids": ids},
    )
    assert decode.body["prompt_token_ids"] == ids
    assert decode.content == (await http.chat(d, messages, max_tokens=64)).content
    generated = decode.body["choices"][0]["token_ids"]
    again = await http.post(d, "/tokenize", {"prompt": decode.content})
    assert again.body["tokens"] == [t for t in generated if t < 256]


@async_test(timeout=15)
async def test_pinned_blocks_survive_pressure(start_emulator: StartEmulator, http: Client) -> None:
    p = await start_emulator(enable_prefix_caching=False)
    d = await start_emulator(num_blocks=64)
    first = conversation()
    _, decode = await pd_turn(http, p, d, first)
    assert decode.params is not None
    held = len(decode.params["remote_block_ids"][0])
    for i in range(4):  # fill the rest of D's pool with other conversations
        other = [{"role": "user", "content": f"Unrelated question number {i}. " * 12}]
        assert (await http.chat(d, other, max_tokens=8)).status == 200
    state = await http.state(d)
    assert state["free_blocks"] == 64 - held
    second = next_turn(first, decode.content)
    prefill = await http.prefill(p, second, decode.params)
    assert prefill.pull == "pulled"
    answer = await http.chat(d, second, max_tokens=64, kv_transfer_params=prefill.params)
    assert answer.content == await reference_answer(start_emulator, http, second)


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
    from tests.conftest import free_port

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

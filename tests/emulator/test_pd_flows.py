"""Prefill/decode flows over real HTTP and the real side channel: what a pull saves,
and that answers with reuse are the answers without it.

A conversation runs through a prefiller P and a decoder D as the router drives
them. Unless a test says otherwise P has no local prefix cache, so whatever it
does not pull it must compute.
"""

from __future__ import annotations

import time

from tests.emulator.conftest import StartEmulator
from tests.emulator.helpers import Client, async_test, conversation
from tests.emulator.pd import (
    FirstTurn,
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

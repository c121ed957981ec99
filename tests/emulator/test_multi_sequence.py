"""Requests of several sequences (n choices, batches of prompts), plain and streamed:
their answers, and every block and running request released after, however they end."""

from __future__ import annotations

from emulator import EmulatorServer
from tests.emulator.conftest import StartEmulator
from tests.emulator.helpers import Client, async_test, conversation
from tests.polling import eventually


async def _running_gauge(http: Client, emu: EmulatorServer) -> float:
    async with http.session.get(emu.http_url + "/metrics") as response:
        text = await response.text()
    (line,) = (line for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


async def _all_released(http: Client, emu: EmulatorServer) -> bool:
    state = await http.state(emu)
    return state["free_blocks"] == state["num_blocks"] and await _running_gauge(http, emu) == 0


@async_test()
async def test_chat_n_choices(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    one = await http.chat(emu, conversation(), max_tokens=20, return_token_ids=True)
    two = await http.chat(emu, conversation(), max_tokens=20, return_token_ids=True, n=2)
    assert two.status == 200, two.body
    choices = two.body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:  # the sampler is deterministic: n equal answers
        assert choice["message"] == one.body["choices"][0]["message"]
        assert choice["finish_reason"] == one.body["choices"][0]["finish_reason"]
    usage = two.body["usage"]
    assert usage["prompt_tokens"] == one.body["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert two.body["prompt_token_ids"] == one.body["prompt_token_ids"]
    assert two.body["kv_transfer_params"] is None
    assert await _all_released(http, emu)


@async_test()
async def test_chat_n_choices_streamed(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    plain = await http.chat(emu, conversation(), max_tokens=12, ignore_eos=True)
    body = {
        "messages": conversation(),
        "max_tokens": 12,
        "ignore_eos": True,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await http.stream(emu, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    # vLLM opens with a role delta for each choice, then one choice per chunk
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:3])
    assert all(len(c["choices"]) == 1 and c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    for index in range(3):
        mine = [c["choices"][0] for c in chunks[3:] if c["choices"][0]["index"] == index]
        assert "".join(c["delta"]["content"] for c in mine) == plain.content
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == plain.body["usage"]["prompt_tokens"]
    assert usage_chunk["usage"]["completion_tokens"] == 3 * 12
    assert await _all_released(http, emu)


@async_test()
async def test_completions_batch_with_n(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    prompts = ["Once upon a time, a ferry crossed the bay. ", "The harbour master counted the boats. "]
    singles = [await http.post(emu, "/v1/completions", {"prompt": p, "max_tokens": 16}) for p in prompts]
    answer = await http.post(
        emu, "/v1/completions", {"prompt": prompts, "max_tokens": 16, "n": 2, "return_token_ids": True}
    )
    assert answer.status == 200, answer.body
    choices = answer.body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt_index * n + i, as vLLM
    texts = [c["text"] for c in choices]
    assert texts == [singles[0].body["choices"][0]["text"]] * 2 + [singles[1].body["choices"][0]["text"]] * 2
    assert [c["prompt_token_ids"] for c in choices] == [list(p.encode()) for p in prompts for _ in "nn"]
    usage = answer.body["usage"]
    assert usage["prompt_tokens"] == sum(len(p.encode()) for p in prompts)  # each prompt once
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert await _all_released(http, emu)


@async_test()
async def test_completions_batch_of_token_ids(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    prompts = ["Once upon a time, a ferry crossed the bay. ", "The harbour master counted the boats. "]
    by_text = await http.post(emu, "/v1/completions", {"prompt": prompts, "max_tokens": 16})
    ids = [list(p.encode()) for p in prompts]
    by_ids = await http.post(emu, "/v1/completions", {"prompt": ids, "max_tokens": 16})
    assert by_ids.status == 200, by_ids.body
    assert [c["index"] for c in by_ids.body["choices"]] == [0, 1]
    assert by_ids.body["choices"] == by_text.body["choices"]
    # streamed: one choice per chunk, a prompt's ids in its choice's first chunk (as vLLM)
    body = {"prompt": ids, "max_tokens": 16, "stream": True, "return_token_ids": True}
    events = await http.stream(emu, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    for index, prompt_ids in enumerate(ids):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == by_text.body["choices"][index]["text"]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert mine[-1]["finish_reason"] is not None
    assert await _all_released(http, emu)


@async_test()
async def test_bad_multi_requests_release_everything(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    prompt = "Once upon a time, a ferry crossed the bay. "
    for body, message in (
        ({"prompt": prompt, "n": 0}, "n must be at least 1, got 0."),
        ({"prompt": prompt, "n": -3}, "n must be at least 1, got -3."),
        ({"prompt": [prompt, [104, 105]]}, None),  # texts and ids mixed
        ({"prompt": [prompt, ""], "n": 2}, "The prompt must contain at least one token."),
        ({"prompt": prompt, "n": 5000}, "5000 sequences need more KV blocks than the engine has."),
    ):
        answer = await http.post(emu, "/v1/completions", body)
        assert answer.status == 400, body
        assert message is None or answer.body["error"]["message"] == message
    # A bad prompt in a batch is refused before the good ones are prefilled.
    assert emu.engine.metrics.total("vllm:prompt_tokens") == 0
    # best_of left vLLM's API: ignored like any unknown field
    ignored = await http.post(emu, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "best_of": 3})
    assert ignored.status == 200 and len(ignored.body["choices"]) == 1
    assert await _all_released(http, emu)


@async_test(timeout=15)
async def test_multi_stream_disconnect_releases_everything(
    start_emulator: StartEmulator, http: Client
) -> None:
    emu = await start_emulator(decode_ms_per_token=20)
    body = {"messages": conversation(), "max_tokens": 500, "ignore_eos": True, "n": 2, "stream": True}
    async with http.session.post(emu.http_url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.content.readline()
        response.close()
    await eventually(lambda: _all_released(http, emu))


@async_test()
async def test_prefill_with_n_answers_the_params_of_one_sequence(
    start_emulator: StartEmulator, http: Client
) -> None:
    """As vLLM: each of the n sequences holds its blocks for a decoder; the answer names one."""
    emu = await start_emulator()
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    answer = await http.chat(emu, conversation(), max_tokens=1, n=2, kv_transfer_params=kv)
    assert answer.status == 200, answer.body
    held = (await http.state(emu))["held_requests"]
    # (the engine's own ids: the answer's id with a random suffix, as vLLM's)
    assert len(held) == 2 and all(
        h.startswith(f"{i}_{answer.body['id']}-") for i, h in enumerate(sorted(held))
    )
    assert answer.params is not None and answer.params["remote_request_id"] in held

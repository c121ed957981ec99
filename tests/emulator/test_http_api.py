"""The OpenAI-compatible surface: shapes, errors, streaming, metrics, prompts as rendered
and tokenized, request ids."""

from __future__ import annotations

import asyncio
import time

from router.upstream import tokenize_request
from tests.emulator.conftest import StartEmulator
from tests.emulator.helpers import Client, async_test, conversation

MODEL = "kvferry/emulated-model"


@async_test()
async def test_health_models_tokenize(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator(max_model_len=4096)
    async with http.session.get(emu.http_url + "/health") as response:
        assert response.status == 200
    async with http.session.get(emu.http_url + "/v1/models") as response:
        models = await response.json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 4096

    by_prompt = await http.post(emu, "/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert by_prompt.body == {"count": 6, "max_model_len": 4096, "tokens": list("héllo".encode())}
    by_messages = await http.post(emu, "/tokenize", {"model": MODEL, "messages": conversation()})
    assert by_messages.body["count"] == len(by_messages.body["tokens"]) > 100
    back = await http.post(emu, "/detokenize", {"model": MODEL, "tokens": by_prompt.body["tokens"]})
    assert back.body == {"prompt": "héllo"}


@async_test()
async def test_version_is_the_vllm_release_followed(start_emulator: StartEmulator, http: Client) -> None:
    """vLLM serves GET /version as {"version": "0.32.0"} (its multi-turn benchmark asks)."""
    emu = await start_emulator()
    async with http.session.get(emu.http_url + "/version") as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        assert await response.json() == {"version": "0.32.0"}


@async_test()
async def test_an_api_key_guards_the_v1_routes_as_in_vllm(
    start_emulator: StartEmulator, http: Client
) -> None:
    emu = await start_emulator(api_key="sk-emu")
    session = http.session
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-emu"}):
        async with session.get(emu.http_url + "/v1/models", headers=headers) as r:
            assert (r.status, await r.json()) == (401, {"error": "Unauthorized"}), headers
        async with session.post(emu.http_url + "/v1/chat/completions", json={}, headers=headers) as r:
            assert r.status == 401  # refused before the body is looked at
    key = {"Authorization": "Bearer sk-emu"}
    async with session.get(emu.http_url + "/v1/models", headers=key) as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL
    async with session.post(
        emu.http_url + "/v1/chat/completions", json={"messages": conversation(), "max_tokens": 2}, headers=key
    ) as r:
        assert r.status == 200
    for path in ("/health", "/metrics", "/version"):  # outside /v1: open, as in vLLM
        async with session.get(emu.http_url + path) as r:
            assert r.status == 200, path
    assert (await http.post(emu, "/tokenize", {"prompt": "hi"})).status == 200


@async_test()
async def test_errors_look_like_vllm(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator(max_model_len=512)
    wrong_model = await http.chat(emu, conversation(), model="other")
    assert wrong_model.status == 404
    assert wrong_model.body["error"]["type"] == "NotFoundError"
    assert wrong_model.body["error"]["code"] == 404

    for bad in (
        {"model": MODEL},  # no messages
        {"messages": "not a list"},
        {"messages": [{"content": "no role"}]},
        {"messages": conversation(), "max_tokens": 10_000},  # beyond max_model_len
        {"messages": conversation(), "n": 0},
        {"messages": conversation(), "n": -1},
        {"messages": conversation(), "n": 2, "temperature": 0},  # vLLM: greedy means n=1
        {"messages": conversation(), "kv_transfer_params": {"prompt_token_ids": ["x"]}},
    ):
        answer = await http.post(emu, "/v1/chat/completions", bad)
        assert answer.status == 400, bad
        assert set(answer.body["error"]) >= {"message", "type", "code"}
        assert answer.body["error"]["code"] == 400
    nested = b'{"prompt": "hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # too deep to decode
    for raw in (b"{not json", nested):
        async with http.session.post(emu.http_url + "/v1/completions", data=raw) as response:
            assert response.status == 400, raw[:40]
            assert (await response.json())["error"]["code"] == 400


@async_test()
async def test_chat_answer_shape(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    answer = await http.chat(
        emu, conversation(), model=MODEL, max_tokens=40, return_token_ids=True, session_id="conv-9"
    )
    body = answer.body
    assert answer.status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert (
        body["prompt_token_ids"]
        == (await http.post(emu, "/tokenize", {"messages": conversation()})).body["tokens"]
    )
    assert body["kv_transfer_params"] is None  # a plain request retains nothing
    assert body["session_id"] == "conv-9"
    assert choice["message"]["content"].isprintable()
    again = await http.chat(emu, conversation(), max_tokens=40)
    assert again.content == answer.content  # deterministic
    # null is the default for vLLM's optional fields, not a 400
    nulls = await http.chat(emu, conversation(), max_tokens=40, stream=None, n=None, return_token_ids=None)
    assert nulls.status == 200 and nulls.content == answer.content
    assert again.count("cached") > 0  # and served from the prefix cache


@async_test()
async def test_a_cache_salt_has_a_prefix_cache_of_its_own(
    start_emulator: StartEmulator, http: Client
) -> None:
    """As vLLM: the salt is the first block's extra key, so a salted request hits only blocks
    of its own salt, and the answer is the same either way."""
    emu = await start_emulator()
    first = await http.chat(emu, conversation(), max_tokens=4, cache_salt="tenant-a")
    assert first.status == 200 and first.count("cached") == 0
    same = await http.chat(emu, conversation(), max_tokens=4, cache_salt="tenant-a")
    assert same.count("cached") > 0 and same.content == first.content
    for other in ({"cache_salt": "tenant-b"}, {}):
        miss = await http.chat(emu, conversation(), max_tokens=4, **other)
        assert miss.count("cached") == 0 and miss.content == first.content, other
    empty = await http.chat(emu, conversation(), max_tokens=4, cache_salt="")
    assert empty.status == 400 and "cache_salt" in empty.body["error"]["message"]


@async_test()
async def test_completions_plain_and_streamed(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    prompt = "Once upon a time, a ferry crossed the bay. " * 3
    plain = await http.post(
        emu, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 30, "return_token_ids": True}
    )
    assert plain.body["object"] == "text_completion"
    choice = plain.body["choices"][0]
    # vLLM's completion answers carry the prompt's fields in the choice (a chat's, top-level)
    assert choice["prompt_token_ids"] == list(prompt.encode()) and "prompt_token_ids" not in plain.body
    streamed = {"prompt": prompt, "max_tokens": 30, "stream": True, "return_token_ids": True}
    with_ids = await http.stream(emu, "/v1/completions", streamed)
    assert with_ids[0]["choices"][0]["prompt_token_ids"] == list(prompt.encode())
    assert not any("prompt_token_ids" in e for e in with_ids[:-1])
    events = await http.stream(emu, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "stream": True})
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == choice["text"]
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert "kv_transfer_params" not in events[-2]  # a plain request retains nothing

    ids = await http.post(emu, "/v1/completions", {"prompt": list(prompt.encode()), "max_tokens": 30})
    assert ids.body["choices"][0]["text"] == choice["text"]
    capped = await http.post(emu, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert capped.body["choices"][0]["finish_reason"] == "length"
    assert capped.body["usage"]["completion_tokens"] == 3


@async_test()
async def test_metrics(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    await http.chat(emu, conversation(), max_tokens=5, ignore_eos=True)
    async with http.session.get(emu.http_url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    assert f'vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}} 5.0' in text
    assert "vllm:prompt_tokens_total" in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length"' in text
    assert "vllm:kv_cache_usage_perc" in text
    assert f'engine_id="{emu.engine_id}"' in text


@async_test(timeout=15)
async def test_prefill_is_serialized(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator(prefill_ms_per_token=0.5, enable_prefix_caching=False)
    prompts = [f"Question {i}: " + "why is the sea salty? " * 10 for i in range(4)]
    began = time.perf_counter()
    answers = await asyncio.gather(
        *(http.post(emu, "/v1/completions", {"prompt": p, "max_tokens": 1}) for p in prompts)
    )
    elapsed = time.perf_counter() - began
    total_tokens = sum(a.count("computed") for a in answers)
    assert elapsed >= total_tokens * 0.5 / 1000 * 0.95  # one GPU: prefills queue, not overlap


@async_test()
async def test_engine_id_is_per_start_unless_given(start_emulator: StartEmulator) -> None:
    first = await start_emulator()
    second = await start_emulator()
    fixed = await start_emulator(engine_id="engine-a")
    assert first.engine_id != second.engine_id
    assert fixed.engine_id == "engine-a"


@async_test()
async def test_prompt_token_ids_are_checked(start_emulator: StartEmulator, http: Client) -> None:
    """As vLLM 0.32's chat path checks them (renderers/online_renderer.py)."""
    emu = await start_emulator()
    not_ids = "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers."
    outside = "The prompt contains token ids outside the vocabulary."
    for ids, message in (
        ([104, True], not_ids),
        ([104, 105.0], not_ids),
        ("104", not_ids),
        ([104, None], not_ids),
        ([104, 258], outside),
        ([-1, 104], not_ids),
        ([], not_ids),
    ):
        answer = await http.chat(
            emu, conversation(), max_tokens=2, kv_transfer_params={"prompt_token_ids": ids}
        )
        assert (answer.status, answer.body["error"]["message"]) == (400, message), ids
    ok = await http.chat(
        emu, [], max_tokens=2, return_token_ids=True, kv_transfer_params={"prompt_token_ids": [104, 257]}
    )
    assert ok.status == 200 and ok.body["prompt_token_ids"] == [104, 257]
    assert (await http.post(emu, "/detokenize", {"tokens": [104, 258]})).status == 400


_TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}


@async_test()
async def test_tokenize_renders_what_the_chat_request_renders(
    start_emulator: StartEmulator, http: Client
) -> None:
    """What the router asks /tokenize (router.upstream.tokenize_request) is the prompt the
    engine computes for the chat request itself, for every field vLLM's /tokenize takes:
    the engines render the prompt, the router digests /tokenize's ids."""
    emu = await start_emulator()
    messages = conversation()
    for fields in (
        {},
        {"tools": [_TOOL]},
        {"chat_template_kwargs": {"enable_thinking": False, "tools": [_TOOL]}},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True, "chat_template": "{{ messages }}"},
    ):
        body = {"messages": messages, "max_tokens": 1, **fields}
        asked = tokenize_request("/v1/chat/completions", body)
        assert isinstance(asked, dict)
        tokenized = await http.post(emu, "/tokenize", asked)
        chat = await http.chat(emu, **{**body, "return_token_ids": True})
        assert chat.status == 200 and tokenized.status == 200, fields
        assert chat.body["prompt_token_ids"] == tokenized.body["tokens"], fields


_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@async_test()
async def test_which_requests_take_forwarded_prompt_token_ids(
    start_emulator: StartEmulator, http: Client
) -> None:
    """vLLM 0.32 takes kv_transfer_params.prompt_token_ids as a chat request's prompt (PR
    48145), not a completion's; releases before it render every chat request themselves
    (chat_prompt_token_ids off). Messages with media are rendered, the ids left unchecked."""
    forwarded = [104, 105, 257]
    rendered = (await http.post(await start_emulator(), "/tokenize", {"messages": conversation()})).body
    for taken, emu in (
        (True, await start_emulator()),
        (False, await start_emulator(chat_prompt_token_ids=False)),
    ):
        chat = await http.chat(
            emu,
            conversation(),
            max_tokens=2,
            return_token_ids=True,
            kv_transfer_params={"prompt_token_ids": forwarded},
        )
        assert chat.status == 200
        assert chat.body["prompt_token_ids"] == (forwarded if taken else rendered["tokens"]), taken
        completion = await http.post(
            emu,
            "/v1/completions",
            {
                "prompt": "hi",
                "max_tokens": 2,
                "return_token_ids": True,
                "kv_transfer_params": {"prompt_token_ids": forwarded},
            },
        )
        assert completion.status == 200
        assert completion.body["choices"][0]["prompt_token_ids"] == list(b"hi"), taken
    media = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, _IMAGE]}]
    answer = await http.chat(emu, media, max_tokens=2, kv_transfer_params={"prompt_token_ids": "not ids"})
    # rendered, not read: the emulator's template takes no images (vLLM's would)
    assert answer.status == 400 and "text content" in answer.body["error"]["message"]


@async_test()
async def test_json_answers_keep_their_content_type(start_emulator: StartEmulator, http: Client) -> None:
    emu = await start_emulator()
    for path, body in (
        ("/tokenize", {"prompt": "héllo ✓"}),
        ("/v1/chat/completions", {"messages": conversation(), "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": "not a list"}),
    ):
        async with http.session.post(emu.http_url + path, json=body) as response:
            assert response.headers["Content-Type"] == "application/json; charset=utf-8"
            assert isinstance(await response.json(), dict)
    tokens = (await http.post(emu, "/tokenize", {"prompt": "héllo ✓"})).body["tokens"]
    assert (await http.post(emu, "/detokenize", {"tokens": tokens})).body == {"prompt": "héllo ✓"}


@async_test(timeout=10)
async def test_a_stream_that_fails_once_started_ends_with_an_error_event(
    start_emulator: StartEmulator, http: Client
) -> None:
    """Out of KV blocks while decoding, after the 200 and the first tokens went out: vLLM
    sends an error event and [DONE]; the client must not be left waiting."""
    emu = await start_emulator(num_blocks=4, block_wait_timeout=0.2)
    prompt = "Once upon a time, a ferry crossed the bay. " * 1  # 2 full blocks of 16 bytes
    body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "stream": True}
    events = await http.stream(emu, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503 and any("choices" in e for e in events[:-2])


async def test_a_clients_request_id_names_the_answer_and_never_collides(
    start_emulator: StartEmulator, http: Client
) -> None:
    """As vLLM: the answer's id is made of the client's X-Request-Id (else of the body's
    request_id), echoed in the header; the engine's own ids get a random suffix (#27987), so
    two requests with one id hold their blocks apart."""
    emu = await start_emulator()
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    body = {"messages": conversation(), "max_tokens": 1, "kv_transfer_params": kv}
    answers = []
    for _ in range(2):
        async with http.session.post(
            emu.http_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "mine-7"}
        ) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "mine-7"
            answers.append(await r.json())
    assert [a["id"] for a in answers] == ["chatcmpl-mine-7"] * 2
    held = set((await http.state(emu))["held_requests"])
    ids = {a["kv_transfer_params"]["remote_request_id"] for a in answers}
    assert len(ids) == 2 and ids <= held and all(i.startswith("chatcmpl-mine-7-") for i in ids)
    by_body = await http.post(emu, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "request_id": "b1"})
    assert by_body.body["id"] == "cmpl-b1" and by_body.headers["X-Request-Id"] == "cmpl-b1"


def test_what_the_template_is_given_merges_as_vllm_does() -> None:
    """As vLLM: the tools a default, the request's chat_template_kwargs over them, and its
    own template fields that are set (not None, not "auto") over both (merge_kwargs)."""
    from emulator.api_requests import template_context

    kwargs = {"reasoning_effort": "low", "enable_thinking": False}
    assert template_context(None, kwargs, {"reasoning_effort": "high"}) == {
        "reasoning_effort": "high",
        "enable_thinking": False,
    }
    assert template_context(None, kwargs, {"reasoning_effort": None, "documents": "auto"}) == kwargs
    assert template_context([1], None, {}) == {"tools": [1]}
    assert template_context([1], {"tools": [2]}, {}) == {"tools": [2]}  # (tools are a default)

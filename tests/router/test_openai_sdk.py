"""The router as the official OpenAI Python SDK sees it.

The router promises clients the same answers as vLLM's; most clients read them through
this SDK, which parses every answer and stream chunk into its types and maps error
statuses to exception classes. Each parsed object is also validated strictly against the
SDK's pydantic model (the SDK itself only coerces). Everything is real: etcd, the daemon,
emulated P and D with their sidecars, the router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI, AsyncStream
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from router import Router
from tests.router.conftest import MODEL, MakeStack, Reference, Stack
from tests.router.helpers import CHAT, COMPLETIONS, first_turn, next_turn, tokenize

M = TypeVar("M", bound=openai.BaseModel)
Sdk = Callable[..., AsyncOpenAI]
FINISHED = ("stop", "length")


@pytest.fixture
async def sdk() -> AsyncIterator[Sdk]:
    """SDK clients of routers (no retries: every answer is the router's first); closed at teardown."""
    clients: list[AsyncOpenAI] = []

    def make(router: Router, api_key: str = "sk-anything") -> AsyncOpenAI:
        client = AsyncOpenAI(base_url=router.url + "/v1", api_key=api_key, max_retries=0, timeout=30)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def served(make_stack: MakeStack, sdk: Sdk) -> tuple[Stack, AsyncOpenAI]:
    stack = await make_stack()
    return stack, sdk(await stack.router())


def counts(usage: CompletionUsage | None) -> tuple[int, int, int]:
    assert usage is not None
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def strict(obj: M) -> M:
    """`obj` validated field by field in pydantic's strict mode, from its JSON (the SDK
    constructs its objects without validating; extra fields stay allowed, as in the SDK)."""
    return type(obj).model_validate_json(obj.to_json(), strict=True)


async def drain(stream: AsyncStream[M]) -> list[M]:
    async with stream:
        return [chunk async for chunk in stream]


async def test_chat_completions_parse_and_answer_as_the_engine(
    make_stack: MakeStack, sdk: Sdk, reference: Reference, http: aiohttp.ClientSession
) -> None:
    stack, client = await served(make_stack, sdk)
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("ferries"), "max_tokens": 24}
    expected = await reference(CHAT, body)
    prompt_tokens = len(await tokenize(http, stack.prefills[0], body["messages"]))

    completion = strict(await client.chat.completions.create(**body))
    assert isinstance(completion, ChatCompletion) and completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason in FINISHED
    assert completion.model == MODEL
    usage = counts(completion.usage)
    assert usage[0] == prompt_tokens and usage[1] > 0 and usage[2] == usage[0] + usage[1]

    stream = await client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    chunks = [strict(chunk) for chunk in await drain(stream)]
    assert all(isinstance(c, ChatCompletionChunk) and c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    *with_choices, last = chunks
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected
    assert with_choices[-1].choices[0].finish_reason in FINISHED
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert last.choices == [] and counts(last.usage) == usage
    assert all(c.usage is None for c in with_choices)


async def test_legacy_completions_parse_and_answer_as_the_engine(
    make_stack: MakeStack, sdk: Sdk, reference: Reference
) -> None:
    _, client = await served(make_stack, sdk)
    body: dict[str, Any] = {"model": MODEL, "prompt": "A ferry crossed the bay. " * 12, "max_tokens": 24}
    expected = await reference(COMPLETIONS, body)

    completion = strict(await client.completions.create(**body))
    assert isinstance(completion, Completion) and completion.object == "text_completion"
    [choice] = completion.choices
    assert choice.text == expected and choice.finish_reason in FINISHED
    usage = counts(completion.usage)
    assert usage[1] > 0 and usage[2] == usage[0] + usage[1]

    stream = await client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    chunks = await drain(stream)
    *with_choices, last = chunks
    assert all(isinstance(c, Completion) and c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in with_choices) == expected
    # The SDK types a completion chunk as a whole Completion, whose finish_reason may not be
    # null: the chunks before the last (null there, as from vLLM and OpenAI) cannot validate.
    assert strict(with_choices[-1]).choices[0].finish_reason in FINISHED
    assert strict(last).choices == [] and counts(last.usage) == usage


async def test_models_list_names_the_served_model(make_stack: MakeStack, sdk: Sdk) -> None:
    _, client = await served(make_stack, sdk)
    models = [strict(m) async for m in client.models.list()]
    assert [(m.id, m.object) for m in models] == [(MODEL, "model")]


async def test_a_second_turn_through_the_sdk_pulls_and_answers_the_same(
    make_stack: MakeStack, sdk: Sdk, reference: Reference
) -> None:
    stack, client = await served(make_stack, sdk)
    conversation = {"conversation_id": "sdk-conv"}
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("harbours"), "max_tokens": 32}

    raw = await client.chat.completions.with_raw_response.create(**body, extra_body=conversation)
    reuse = raw.headers["X-Kvferry-Reuse"], raw.headers["X-Kvferry-Reuse-Reason"]
    assert reuse == ("RECOMPUTE", "no_lease")
    answer = strict(raw.parse()).choices[0].message.content
    assert answer is not None and answer == await reference(CHAT, body)
    await stack.registrations_idle()

    second = {**body, "messages": next_turn(body["messages"], answer)}
    raw = await client.chat.completions.with_raw_response.create(
        **second, extra_body=conversation, stream=True
    )
    assert raw.headers["X-Kvferry-Reuse"] == "PULL", dict(raw.headers)
    assert int(raw.headers["X-Kvferry-Reused-Tokens"]) > 0
    text = "".join(c.choices[0].delta.content or "" for c in await drain(raw.parse()) if c.choices)
    assert text == await reference(CHAT, second)


async def test_bad_requests_raise_bad_request_error_saying_what_is_wrong(
    make_stack: MakeStack, sdk: Sdk
) -> None:
    _, client = await served(make_stack, sdk)
    cases: list[tuple[dict[str, Any], str]] = [  # the router's own check; D's, passed through
        ({"messages": []}, "'messages' is required"),
        ({"messages": first_turn("tides"), "max_tokens": -1}, "max_tokens must be at least 1"),
    ]
    for fields, message in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, stream=stream, **fields)
            assert caught.value.status_code == 400 and message in caught.value.message, caught.value.body
            assert caught.value.type == "BadRequestError"


async def test_api_keys_wrong_key_raises_authentication_error_right_key_gets_in(
    make_stack: MakeStack, sdk: Sdk, reference: Reference
) -> None:
    stack = await make_stack()
    router = await stack.router(server__api_keys=("sk-right",))
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("tolls"), "max_tokens": 16}
    wrong = sdk(router, api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as caught:
        await wrong.chat.completions.create(**body)
    assert caught.value.body == "Unauthorized"  # vLLM's 401 body: {"error": "Unauthorized"}
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()

    right = sdk(router, api_key="sk-right")
    completion = await right.chat.completions.create(**body)
    assert completion.choices[0].message.content == await reference(CHAT, body)
    assert [m.id async for m in right.models.list()] == [MODEL]

"""The OpenAI objects of an answer: envelopes, choices, usage, and a whole JSON answer.

An ``Answer`` is what every sequence of one answer shares (id, model, kind, request,
time); a ``Shape`` builds the objects of one sequence (choice ``index``). Sequences of
one answer decode side by side (``interleaved``), as a real engine batches them.
Answers are encoded with msgspec (``json_encode``, ``json_response``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from emulator.api_requests import GenerationRequest
from emulator.engine import RunningRequest
from emulator.tokenizer import decode

#: Answers are encoded with msgspec: the stdlib encoder takes milliseconds for the token id
#: lists of long prompts (``/tokenize``, ``return_token_ids``), time no timing model counts.
json_encode = msgspec.json.Encoder().encode


def json_response(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``web.json_response`` with msgspec's encoder (same content type, compact JSON)."""
    return web.Response(
        body=json_encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
        charset="utf-8",
    )


@dataclass(frozen=True)
class Answer:
    """What every sequence of one answer shares: its id, model, kind, request and time."""

    request_id: str
    model: str
    chat: bool
    body: GenerationRequest
    created: int
    given_id: str = ""
    """The request's own X-Request-Id ("" = none): echoed as vLLM's request-id middleware
    does (with ``--enable-request-id-headers``), else the answer's id is."""

    @property
    def x_request_id(self) -> str:
        """The answer's X-Request-Id header."""
        return self.given_id or self.request_id

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        """The object around `choices`: a whole answer's, or a stream chunk's."""
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.request_id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def prompt_ids(self, prompt: Sequence[int]) -> list[int] | None:
        """A prompt's token ids as answers carry them: only when the request asked."""
        return list(prompt) if self.body.return_token_ids else None


class Shape:
    """Builds OpenAI objects for one sequence (choice ``index``) of an answer."""

    def __init__(self, answer: Answer, running: RunningRequest, index: int = 0) -> None:
        self.answer = answer
        self.running = running
        self.index = index

    @property
    def chat(self) -> bool:
        """Whether the answer is a chat completion."""
        return self.answer.chat

    @property
    def body(self) -> GenerationRequest:
        """The request answered."""
        return self.answer.body

    def headers(self) -> dict[str, str]:
        """The answer's headers: its id, and where this sequence's prompt KV came from."""
        stats = self.running.stats
        return {
            "X-Request-Id": self.answer.x_request_id,
            "X-Kvferry-Emulator-Pull": stats.pull,
            "X-Kvferry-Emulator-Cached-Tokens": str(stats.local_cached_tokens),
            "X-Kvferry-Emulator-Pulled-Tokens": str(stats.pulled_tokens),
            "X-Kvferry-Emulator-Computed-Tokens": str(stats.computed_tokens),
        }

    def text(self, tokens: list[int]) -> str:
        """The text of generated tokens, as the request asked them decoded."""
        return decode(tokens, skip_special_tokens=self.body.skip_special_tokens)

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        """The answer's envelope (`Answer.envelope`)."""
        return self.answer.envelope(choices, chunk)

    def choice(self, tokens: list[int], finish_reason: str | None, delta: bool) -> dict[str, Any]:
        """This sequence's choice: a stream chunk's (`delta`) or a whole answer's."""
        choice: dict[str, Any] = {"index": self.index}
        if self.chat and delta:
            choice["delta"] = {"content": self.text(tokens)} if tokens else {}
        elif self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": self.text(tokens),
                "tool_calls": [],
            }
        else:
            choice["text"] = self.text(tokens)
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = None
        if self.body.return_token_ids:
            choice["token_ids"] = list(tokens)
        elif not delta:  # (vLLM dumps a whole answer with its unset fields; chunks without)
            choice["token_ids"] = None
        return choice

    def prompt_token_ids(self) -> list[int] | None:
        """This sequence's prompt ids when the request asked for them, else None."""
        return self.answer.prompt_ids(self.running.spec.prompt_token_ids)

    def extras(self, body: dict[str, Any]) -> None:
        """Add vLLM's extra top-level fields (``session_id``) to a last chunk or an answer."""
        if self.running.spec.session_id is not None:
            body["session_id"] = self.running.spec.session_id


def usage(shapes: list[Shape], n: int) -> dict[str, Any]:
    """Usage of sequences, prompt by prompt, n each: as in vLLM, a prompt counts once however
    many sequences share it. Cached tokens are the first sequence's, like the headers."""
    prompt = sum(shape.running.stats.prompt_tokens for shape in shapes[::n])
    completion = sum(len(shape.running.output_token_ids) for shape in shapes)
    stats = shapes[0].running.stats
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": stats.local_cached_tokens + stats.pulled_tokens},
    }


async def interleaved(shapes: list[Shape]) -> AsyncGenerator[tuple[Shape, int, bool], None]:
    """``(shape, token, is_last)`` of several sequences as they come: they decode side by side,
    as a real engine batches them. Closing this stops every sequence still decoding."""
    streams = [shape.running.tokens() for shape in shapes]
    steps = {asyncio.ensure_future(anext(stream)): k for k, stream in enumerate(streams)}
    try:
        while steps:
            done, _ = await asyncio.wait(steps, return_when=asyncio.FIRST_COMPLETED)
            for step in sorted(done, key=steps.__getitem__):
                k = steps.pop(step)
                token, last = step.result()
                if not last:
                    steps[asyncio.ensure_future(anext(streams[k]))] = k
                yield shapes[k], token, last
    finally:
        for step in steps:
            step.cancel()
        await asyncio.gather(*steps, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def complete(shape: Shape) -> web.Response:
    """Decode one sequence to its end and answer it as JSON."""
    running = shape.running
    async for _token, _last in running.tokens():
        pass
    return _answer([shape], 1, running.kv_transfer_params)


async def complete_many(shapes: list[Shape], n: int) -> web.Response:
    """Decode several sequences side by side and answer them as JSON, one choice each."""
    # vLLM answers with the params of its first prompt's output, which it builds (for n > 1)
    # when the last of that prompt's n sequences finishes, with that sequence's params.
    params_of = shapes[0]
    async with contextlib.aclosing(interleaved(shapes)) as tokens:
        async for shape, _token, last in tokens:
            if last and shape.index < n:
                params_of = shape
    return _answer(shapes, n, params_of.running.kv_transfer_params)


def _answer(shapes: list[Shape], n: int, kv_transfer_params: dict[str, Any] | None) -> web.Response:
    """The JSON answer of finished sequences. For several, the top-level fields (and the
    ``X-Kvferry-Emulator-*`` headers) describe the first sequence."""
    first = shapes[0]
    choices = []
    for shape in shapes:
        running = shape.running
        choice = shape.choice(running.output_token_ids, running.finish_reason, delta=False)
        if not shape.chat:  # a completion's prompt fields are its choices' (a chat's, top-level)
            choice["prompt_logprobs"] = None
            choice["prompt_token_ids"] = shape.prompt_token_ids()
        choices.append(choice)
    body = first.envelope(choices, chunk=False)
    body["usage"] = usage(shapes, n)
    if first.chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = first.prompt_token_ids()
    body["kv_transfer_params"] = kv_transfer_params
    first.extras(body)
    return json_response(body, headers=first.headers())

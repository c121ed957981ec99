"""Streamed answers in vLLM's framing: SSE ``data:`` events, ``[DONE]`` at the end.

A chat stream opens with the role (once for each choice); each token is a chunk of its
sequence's choice; a sequence's last chunk carries its ``kv_transfer_params`` only with
``stream_kv_transfer_params`` (vLLM PR 40186; 0.32 streams carry none). A failure once
the stream began is an error event (vLLM cannot change the status any more).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import structlog
from aiohttp import web

from emulator.api_answers import Answer, Shape, interleaved, json_encode, usage
from emulator.errors import EngineError, error_body

log = structlog.get_logger(__name__)

_Send = Callable[[dict[str, Any] | bytes], Awaitable[None]]


class _Sse:
    """A streamed answer in vLLM's framing: ``data:`` events, an error event for a failure
    once the stream began (vLLM cannot change the status any more), ``[DONE]`` at the end."""

    def __init__(self, request: web.Request, headers: Mapping[str, str]) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any] | bytes) -> None:
        data = payload if isinstance(payload, bytes) else json_encode(payload)
        await self.response.write(b"data: " + data + b"\n\n")

    async def fail(self, exc: EngineError) -> None:
        log.warning("http.stream.failed", path=self.request.path, status=int(exc.status), error=str(exc))
        await self.send(error_body(exc.status, str(exc)))

    async def close(self) -> web.StreamResponse:
        await self.send(b"[DONE]")
        await self.response.write_eof()
        return self.response


async def _open_chat(sse: _Sse, answer: Answer, prompts: Sequence[Sequence[int]]) -> None:
    """A chat stream's first chunks, as vLLM opens one: the role, once for each choice
    (choice k of prompt k), with the prompt's token ids when asked for them."""
    for index, prompt in enumerate(prompts):
        opening = answer.envelope([_role_choice(index)], chunk=True)
        ids = answer.prompt_ids(prompt)
        if ids is not None:  # (a chunk leaves out what is not set, as vLLM's do)
            opening["prompt_token_ids"] = ids
        await sse.send(opening)


def _role_choice(index: int) -> dict[str, Any]:
    """The choice of a chat stream's first chunk: vLLM opens with the role."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


async def stream(request: web.Request, answer: Answer, shapes: list[Shape], n: int) -> web.StreamResponse:
    """SSE answer of one or more sequences; the ``X-Kvferry-Emulator-*`` headers, sent before
    any token, describe one prefill: for several sequences, the first one's."""
    first = shapes[0]
    sse = _Sse(request, first.headers())
    await sse.open()
    if answer.chat:
        await _open_chat(sse, answer, [shape.running.spec.prompt_token_ids for shape in shapes])
    include_usage = bool(answer.body.stream_options and answer.body.stream_options.include_usage)
    try:
        if len(shapes) == 1:
            await _stream_tokens(first, sse.send)
        else:
            await _stream_many(shapes, sse.send)
    except EngineError as exc:
        await sse.fail(exc)
        include_usage = False
    if include_usage:
        tail = answer.envelope([], chunk=True)
        tail["usage"] = usage(shapes, n)
        await sse.send(tail)
    return await sse.close()


async def stream_failed(
    request: web.Request, exc: EngineError, answer: Answer, prompts: list[list[int]]
) -> web.StreamResponse:
    """A streamed request whose KV load failed. vLLM validates a request before its stream
    starts, but a failed load is how the engine finishes it (``finish_reason`` "error"):
    a chat stream opens as ever (the role, once for each sequence's choice), then the
    error event, then its end (vLLM releases before #40986 drop that event); an answer not
    streamed gets a 500."""
    sse = _Sse(request, {"X-Request-Id": answer.x_request_id})
    await sse.open()
    if answer.chat:
        await _open_chat(sse, answer, prompts)
    await sse.fail(exc)
    return await sse.close()


def _token_chunk(shape: Shape, token: int, last: bool) -> dict[str, Any]:
    """The chunk of one sequence's token (every sequence of an answer shares its envelope).
    A completion's prompt ids ride in its choice's first chunk, as in vLLM (a chat's went
    out with the role); a sequence's last chunk carries its own ``kv_transfer_params``."""
    running = shape.running
    choice = shape.choice([token], running.finish_reason if last else None, delta=True)
    if not shape.chat and shape.body.return_token_ids and len(running.output_token_ids) == 1:
        choice["prompt_token_ids"] = shape.prompt_token_ids()
    chunk = shape.envelope([choice], chunk=True)
    if last:
        if running.kv_transfer_params is not None and running.streams_params:
            chunk["kv_transfer_params"] = running.kv_transfer_params
        shape.extras(chunk)
    return chunk


async def _stream_tokens(shape: Shape, send: _Send) -> None:
    async for token, last in shape.running.tokens():
        await send(_token_chunk(shape, token, last))


async def _stream_many(shapes: list[Shape], send: _Send) -> None:
    """Chunks of several sequences as they come, one choice each."""
    async with contextlib.aclosing(interleaved(shapes)) as tokens:
        async for shape, token, last in tokens:
            await send(_token_chunk(shape, token, last))

"""vLLM's OpenAI-compatible HTTP surface over an emulated engine (aiohttp).

Routes: ``/v1/chat/completions``, ``/v1/completions`` (SSE or JSON),
``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``,
``/metrics``, ``/reset_prefix_cache`` and the emulator-only ``/emulator/state``.

Handlers parse and validate, call the engine, and shape the answer; domain
errors become vLLM's ``{"error": {...}}`` bodies in one middleware. A stream's
final chunk (the one with ``finish_reason``) carries ``kv_transfer_params`` only with
``stream_kv_transfer_params`` (vLLM PR 40186; 0.32 streams carry none); a JSON answer
carries them at the top level. A request refused before admission that came with a
prefill's params (``do_remote_prefill``) has the engine tell their holder to free the
blocks, as vLLM's serving layer does (PR 41269); nothing is kept for it here. Each answer has
``X-Kvferry-Emulator-*`` headers telling where the prompt's KV came from.

``n`` > 1 and batched completion prompts run one engine request per sequence, as
vLLM does, and answer with one choice per sequence (``prompt_index * n + i``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from emulator.config import VLLM_VERSION, EmulatorConfig
from emulator.engine import Engine, RunningRequest
from emulator.errors import EngineError, InvalidRequest, KVLoadFailed, ModelNotFound, error_body
from emulator.prompts import forwarded_prompt_ids
from emulator.sequence import GenerationSpec
from emulator.tokenizer import (
    VOCAB_SIZE,
    TemplateError,
    apply_chat_template,
    decode,
    encode,
)
from kvferry.decoding import UNDECODABLE

log = structlog.get_logger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)
_T = TypeVar("_T")

_BAD_REQUEST: tuple[type[Exception], ...] = (*UNDECODABLE, TemplateError)
"""A body that does not decode (or nests too deep), or a chat template that fails on it."""
#: Answers are encoded with msgspec: the stdlib encoder takes milliseconds for the token id
#: lists of long prompts (``/tokenize``, ``return_token_ids``), time no timing model counts.
_json_encode = msgspec.json.Encoder().encode


def json_response(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``web.json_response`` with msgspec's encoder (same content type, compact JSON)."""
    return web.Response(
        body=_json_encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
        charset="utf-8",
    )


class StreamOptions(msgspec.Struct):
    """OpenAI ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    # null means the default for these, as in vLLM's request models
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    session_id: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    # only read to refuse n > 1 with greedy sampling, as vLLM does; the sampler ignores it
    temperature: float | None = None
    skip_special_tokens: bool = True


class ChatCompletionRequest(_Common, kw_only=True):
    """Body of ``/v1/chat/completions`` (unknown fields are ignored, like vLLM)."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # what vLLM's chat request also hands the template, and its /tokenize has no field for
    documents: list[Any] | None = None
    reasoning_effort: str | None = None

    def template_context(self) -> dict[str, Any]:
        given = {"documents": self.documents, "reasoning_effort": self.reasoning_effort}
        return template_context(self.tools, self.chat_template_kwargs, given)


class CompletionRequest(_Common, kw_only=True):
    """Body of ``/v1/completions`` (``best_of``, gone from vLLM, is ignored like vLLM does)."""

    # a text, token ids, or a batch of texts or of token id lists
    prompt: str | list[int | str | list[int]]
    max_tokens: int | None = 16
    use_beam_search: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``/tokenize``: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def template_context(self) -> dict[str, Any]:
        return template_context(self.tools, self.chat_template_kwargs, {})


def template_context(
    tools: list[Any] | None, kwargs: dict[str, Any] | None, given: dict[str, Any]
) -> dict[str, Any]:
    """What the chat template is given besides the messages, merged as vLLM does: the
    tools as a default the request's chat_template_kwargs may override, and the request's
    own template fields that are set (not None, not "auto": `merge_kwargs`) over both."""
    defaults = {"tools": tools} if tools is not None else {}
    return {**defaults, **(kwargs or {}), **{k: v for k, v in given.items() if v is not None and v != "auto"}}


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``/detokenize``."""

    tokens: list[int]
    model: str | None = None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map domain and decoding errors to vLLM-shaped error responses."""
    try:
        return await handler(request)
    except EngineError as exc:
        status = exc.status
        message = str(exc)
    except _BAD_REQUEST as exc:
        status = HTTPStatus.BAD_REQUEST
        message = str(exc)
    if status >= 500:
        log.warning("http.request.failed", path=request.path, status=int(status), error=message)
    return json_response(error_body(status, message), status=int(status))


def _decode_body(request_type: type[_T], raw: bytes) -> _T:
    if not raw:
        raise InvalidRequest("The request body must be a JSON object.")
    return msgspec.json.decode(raw, type=request_type)


def _check_model(config: EmulatorConfig, model: str | None) -> None:
    if model is not None and model != config.model:
        raise ModelNotFound(f"The model `{model}` does not exist.")


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


async def health(request: web.Request) -> web.Response:
    """200 while the engine runs."""
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    """The vLLM version the emulator follows, as vLLM answers it (``{"version": ...}``;
    ``vllm/entrypoints/serve/instrumentator/basic.py``, ``show_version``)."""
    return json_response({"version": VLLM_VERSION})


async def models(request: web.Request) -> web.Response:
    """The one served model."""
    config = _engine(request).config
    card = {
        "id": config.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [],
    }
    return json_response({"object": "list", "data": [card]})


async def tokenize(request: web.Request) -> web.Response:
    """Token ids of a prompt or of templated messages."""
    engine = _engine(request)
    body = _decode_body(TokenizeRequest, await request.read())
    _check_model(engine.config, body.model)
    if body.messages is not None:
        tokens = apply_chat_template(
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            context=body.template_context(),
        )
    elif body.prompt is not None:
        tokens = encode(body.prompt)
    else:
        raise InvalidRequest("Either 'prompt' or 'messages' is required.")
    answer: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": engine.config.max_model_len,
        "tokens": tokens,
    }
    if body.return_token_strs:
        answer["token_strs"] = [decode([t], skip_special_tokens=False) for t in tokens]
    return json_response(answer)


async def detokenize(request: web.Request) -> web.Response:
    """Text of token ids."""
    engine = _engine(request)
    body = _decode_body(DetokenizeRequest, await request.read())
    _check_model(engine.config, body.model)
    if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= VOCAB_SIZE):
        raise InvalidRequest("Token ids outside the vocabulary.")
    return json_response({"prompt": decode(body.tokens, skip_special_tokens=False)})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition."""
    payload, content_type = _engine(request).metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Forget cached blocks (refused, still 200, while blocks are in use — like vLLM)."""
    if not _engine(request).reset_prefix_cache():
        log.warning("http.reset_prefix_cache.refused")
    return web.Response(status=200)


async def emulator_state(request: web.Request) -> web.Response:
    """Emulator-only view of blocks and holds."""
    return json_response(_engine(request).snapshot())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completion."""
    engine = _engine(request)
    body = _decode_body(ChatCompletionRequest, await request.read())
    with _rejection_cleanup(engine, body):
        return await _chat(request, engine, body)


async def _chat(request: web.Request, engine: Engine, body: ChatCompletionRequest) -> web.StreamResponse:
    _check_model(engine.config, body.model)
    prompt = None
    if engine.config.chat_prompt_token_ids:  # (vLLM 0.32: `emulator.prompts`)
        prompt = forwarded_prompt_ids(body.kv_transfer_params, body.messages)
    if prompt is None:
        prompt = apply_chat_template(
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            context=body.template_context(),
        )
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    return await _generate(request, engine, body, [prompt], max_tokens, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI (legacy) completion."""
    engine = _engine(request)
    body = _decode_body(CompletionRequest, await request.read())
    with _rejection_cleanup(engine, body):
        if body.stream and body.use_beam_search:  # (vLLM's first check, before the model's)
            raise InvalidRequest("Streaming is not currently supported with beam search")
        if body.use_beam_search:
            raise InvalidRequest("The emulator does not do beam search.")
        return await _completion(request, engine, body)


async def _completion(request: web.Request, engine: Engine, body: CompletionRequest) -> web.StreamResponse:
    _check_model(engine.config, body.model)
    # (kv_transfer_params.prompt_token_ids is not the prompt here, in vLLM neither)
    prompts = _completion_prompts(body.prompt)
    return await _generate(request, engine, body, prompts, body.max_tokens, chat=False)


@contextlib.contextmanager
def _rejection_cleanup(engine: Engine, body: _Common) -> Iterator[None]:
    """A request refused before the engine admitted it (a bad model, prompt or setting)
    that came with a prefill's params: the engine tells their holder to free the blocks,
    as vLLM's ``_with_kv_transfer_rejection_cleanup`` does (PR 41269)."""
    try:
        yield
    except (InvalidRequest, ModelNotFound):
        engine.pulls.kv_transfer_rejected(body.kv_transfer_params)
        raise


def _completion_prompts(prompt: str | list[int | str | list[int]]) -> list[list[int]]:
    """The token ids of each prompt of a completion request."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) == len(prompt):
        return [ids]
    texts = [p for p in prompt if isinstance(p, str)]
    if len(texts) == len(prompt):
        return [encode(text) for text in texts]
    batch = [p for p in prompt if isinstance(p, list)]
    if len(batch) == len(prompt):
        return batch
    raise InvalidRequest("The prompt must be a string, token ids, or a list of strings or of token ids.")


#: vLLM's defaults: ``VLLM_MAX_N_SEQUENCES``, and the temperature below which it samples greedily.
_MAX_N = 16384
_SAMPLING_EPS = 1e-5


def _num_sequences(body: _Common) -> int:
    """``n``, checked as vLLM's ``SamplingParams`` checks it."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise InvalidRequest(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise InvalidRequest(f"n must be at most {_MAX_N}, got {n}.")
    if n > 1 and body.temperature is not None and body.temperature < _SAMPLING_EPS:
        raise InvalidRequest(f"n must be 1 when using greedy sampling, got {n}.")
    return n


def _sequence_ids(request_id: str, num_prompts: int, n: int, chat: bool) -> list[str]:
    """Engine request ids, prompt by prompt, n each: vLLM's ``{id}-{prompt}`` for the prompts of
    a completion and ``{i}_{parent}`` for the n children of one; a plain request keeps its id."""
    if num_prompts == 1 and n == 1:
        return [request_id]
    parents = [request_id] if chat else [f"{request_id}-{p}" for p in range(num_prompts)]
    return [parent if n == 1 else f"{i}_{parent}" for parent in parents for i in range(n)]


async def _generate(
    request: web.Request,
    engine: Engine,
    body: _Common,
    prompts: list[list[int]],
    max_tokens: int | None,
    *,
    chat: bool,
) -> web.StreamResponse:
    n = _num_sequences(body)
    if body.cache_salt is not None and not body.cache_salt:
        raise InvalidRequest("Parameter 'cache_salt' must be a non-empty string if provided.")
    given = request.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{given}"
    # The engine's own ids get a random suffix (vLLM #27987): a client's id, the same for
    # two requests, must not make one request's held blocks the other's.
    internal = f"{request_id}-{uuid.uuid4().hex[:8]}"
    session_id = body.session_id or request.headers.get("X-Session-ID")
    specs = [
        GenerationSpec(
            request_id=sequence_id,
            prompt_token_ids=prompts[k // n],
            max_tokens=max(engine.config.max_model_len - len(prompts[k // n]), 1)
            if max_tokens is None
            else max_tokens,
            ignore_eos=body.ignore_eos,
            kv_transfer_params=body.kv_transfer_params,
            session_id=session_id,
            cache_salt=body.cache_salt,
        )
        for k, sequence_id in enumerate(_sequence_ids(internal, len(prompts), n, chat))
    ]
    if len(specs) > 1:  # (n > 1, or a batch of prompts: choice k is sequence k, of prompt k // n)
        if len(specs) > engine.pool.num_blocks:  # each holds a block of its own at least
            raise InvalidRequest(f"{len(specs)} sequences need more KV blocks than the engine has.")
        for spec in specs:  # a bad one refused before any other is prefilled
            engine.validate(spec)
    answer = _Answer(
        request_id, engine.config.model, chat, body, int(time.time()), request.headers.get("X-Request-Id", "")
    )
    shapes: list[_Shape] = []
    try:
        for spec in specs:  # one engine request each, as vLLM runs them, prefilled in turn
            running = await engine.submit(spec)
            engine.metrics.num_requests_running.inc()
            shapes.append(_Shape(answer, running, len(shapes)))
        if body.stream:
            return await _stream(request, answer, shapes, n)
        return await (_complete(shapes[0]) if len(shapes) == 1 else _complete_many(shapes, n))
    except KVLoadFailed as exc:  # (raised by a prefill: a stream handles its own failures)
        if not body.stream:
            raise
        return await _stream_failed(request, exc, answer, [spec.prompt_token_ids for spec in specs])
    finally:
        for shape in shapes:
            shape.running.abort()
            engine.metrics.num_requests_running.dec()


@dataclass(frozen=True)
class _Answer:
    """What every sequence of one answer shares: its id, model, kind, request and time."""

    request_id: str
    model: str
    chat: bool
    body: _Common
    created: int
    given_id: str = ""
    """The request's own X-Request-Id ("" = none): echoed as vLLM's request-id middleware
    does (with ``--enable-request-id-headers``), else the answer's id is."""

    @property
    def x_request_id(self) -> str:
        return self.given_id or self.request_id

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.request_id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    async def open_chat(self, sse: _Sse, prompts: Sequence[Sequence[int]]) -> None:
        """A chat stream's first chunks, as vLLM opens one: the role, once for each choice
        (choice k of prompt k), with the prompt's token ids when asked for them."""
        for index, prompt in enumerate(prompts):
            opening = self.envelope([_role_choice(index)], chunk=True)
            ids = self.prompt_ids(prompt)
            if ids is not None:  # (a chunk leaves out what is not set, as vLLM's do)
                opening["prompt_token_ids"] = ids
            await sse.send(opening)

    def prompt_ids(self, prompt: Sequence[int]) -> list[int] | None:
        """A prompt's token ids as answers carry them: only when the request asked."""
        return list(prompt) if self.body.return_token_ids else None


class _Shape:
    """Builds OpenAI objects for one sequence (choice ``index``) of an answer."""

    def __init__(self, answer: _Answer, running: RunningRequest, index: int = 0) -> None:
        self.answer = answer
        self.running = running
        self.index = index

    @property
    def chat(self) -> bool:
        return self.answer.chat

    @property
    def body(self) -> _Common:
        return self.answer.body

    def headers(self) -> dict[str, str]:
        stats = self.running.stats
        return {
            "X-Request-Id": self.answer.x_request_id,
            "X-Kvferry-Emulator-Pull": stats.pull,
            "X-Kvferry-Emulator-Cached-Tokens": str(stats.local_cached_tokens),
            "X-Kvferry-Emulator-Pulled-Tokens": str(stats.pulled_tokens),
            "X-Kvferry-Emulator-Computed-Tokens": str(stats.computed_tokens),
        }

    def text(self, tokens: list[int]) -> str:
        return decode(tokens, skip_special_tokens=self.body.skip_special_tokens)

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return self.answer.envelope(choices, chunk)

    def choice(self, tokens: list[int], finish_reason: str | None, delta: bool) -> dict[str, Any]:
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
        return self.answer.prompt_ids(self.running.spec.prompt_token_ids)

    def extras(self, body: dict[str, Any]) -> None:
        if self.running.spec.session_id is not None:
            body["session_id"] = self.running.spec.session_id


def _role_choice(index: int) -> dict[str, Any]:
    """The choice of a chat stream's first chunk: vLLM opens with the role."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _usage(shapes: list[_Shape], n: int) -> dict[str, Any]:
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


async def _interleaved(shapes: list[_Shape]) -> AsyncGenerator[tuple[_Shape, int, bool], None]:
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


async def _complete(shape: _Shape) -> web.Response:
    running = shape.running
    async for _token, _last in running.tokens():
        pass
    return _answer([shape], 1, running.kv_transfer_params)


async def _complete_many(shapes: list[_Shape], n: int) -> web.Response:
    # vLLM answers with the params of its first prompt's output, which it builds (for n > 1)
    # when the last of that prompt's n sequences finishes, with that sequence's params.
    params_of = shapes[0]
    async with contextlib.aclosing(_interleaved(shapes)) as tokens:
        async for shape, _token, last in tokens:
            if last and shape.index < n:
                params_of = shape
    return _answer(shapes, n, params_of.running.kv_transfer_params)


def _answer(shapes: list[_Shape], n: int, kv_transfer_params: dict[str, Any] | None) -> web.Response:
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
    body["usage"] = _usage(shapes, n)
    if first.chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = first.prompt_token_ids()
    body["kv_transfer_params"] = kv_transfer_params
    first.extras(body)
    return json_response(body, headers=first.headers())


Send = Callable[[dict[str, Any] | bytes], Awaitable[None]]


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
        data = payload if isinstance(payload, bytes) else _json_encode(payload)
        await self.response.write(b"data: " + data + b"\n\n")

    async def fail(self, exc: EngineError) -> None:
        log.warning("http.stream.failed", path=self.request.path, status=int(exc.status), error=str(exc))
        await self.send(error_body(exc.status, str(exc)))

    async def close(self) -> web.StreamResponse:
        await self.send(b"[DONE]")
        await self.response.write_eof()
        return self.response


async def _stream(request: web.Request, answer: _Answer, shapes: list[_Shape], n: int) -> web.StreamResponse:
    """SSE answer of one or more sequences; the ``X-Kvferry-Emulator-*`` headers, sent before
    any token, describe one prefill: for several sequences, the first one's."""
    first = shapes[0]
    sse = _Sse(request, first.headers())
    await sse.open()
    if answer.chat:
        await answer.open_chat(sse, [shape.running.spec.prompt_token_ids for shape in shapes])
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
        tail["usage"] = _usage(shapes, n)
        await sse.send(tail)
    return await sse.close()


async def _stream_failed(
    request: web.Request, exc: EngineError, answer: _Answer, prompts: list[list[int]]
) -> web.StreamResponse:
    """A streamed request whose KV load failed. vLLM validates a request before its stream
    starts, but a failed load is how the engine finishes it (``finish_reason`` "error"):
    a chat stream opens as ever (the role, once for each sequence's choice), then the
    error event, then its end (vLLM releases before #40986 drop that event); an answer not
    streamed gets a 500."""
    sse = _Sse(request, {"X-Request-Id": answer.x_request_id})
    await sse.open()
    if answer.chat:
        await answer.open_chat(sse, prompts)
    await sse.fail(exc)
    return await sse.close()


def _token_chunk(shape: _Shape, token: int, last: bool) -> dict[str, Any]:
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


async def _stream_tokens(shape: _Shape, send: Send) -> None:
    async for token, last in shape.running.tokens():
        await send(_token_chunk(shape, token, last))


async def _stream_many(shapes: list[_Shape], send: Send) -> None:
    """Chunks of several sequences as they come, one choice each."""
    async with contextlib.aclosing(_interleaved(shapes)) as tokens:
        async for shape, token, last in tokens:
            await send(_token_chunk(shape, token, last))


def _api_key_middleware(key: str) -> Middleware:
    """vLLM's --api-key check: only the /v1 routes, the key as a bearer token, 401 otherwise."""
    expected = f"Bearer {key}"

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1") and request.headers.get("Authorization") != expected:
            return json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving one engine."""
    middlewares: list[Middleware] = [error_middleware]
    if engine.config.api_key:  # (checked first: vLLM refuses before it parses anything)
        middlewares.insert(0, _api_key_middleware(engine.config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/emulator/state", emulator_state)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    return app

"""vLLM's OpenAI-compatible HTTP surface over an emulated engine (aiohttp).

Routes: ``/v1/chat/completions``, ``/v1/completions`` (SSE or JSON),
``/v1/models``, ``/health``, ``/tokenize``, ``/detokenize``, ``/metrics``,
``/reset_prefix_cache`` and the emulator-only ``/emulator/state``.

Handlers parse and validate, call the engine, and shape the answer; domain
errors become vLLM's ``{"error": {...}}`` bodies in one middleware. A stream's
final chunk (the one with ``finish_reason``) carries ``kv_transfer_params`` as
vLLM >= 0.33 does; a JSON answer carries them at the top level. Each answer has
``X-Kvferry-Emulator-*`` headers telling where the prompt's KV came from.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
import structlog
from aiohttp import web

from emulator.config import EmulatorConfig
from emulator.engine import Engine, GenerationSpec, RunningRequest
from emulator.errors import EngineError, InvalidRequest, ModelNotFound, error_body
from emulator.tokenizer import (
    VOCAB_SIZE,
    TemplateError,
    apply_chat_template,
    decode,
    encode,
)

log = structlog.get_logger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)
_T = TypeVar("_T")

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
    kv_transfer_params: dict[str, Any] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    skip_special_tokens: bool = True


class ChatCompletionRequest(_Common, kw_only=True):
    """Body of ``/v1/chat/completions`` (unknown fields are ignored, like vLLM)."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Common, kw_only=True):
    """Body of ``/v1/completions``."""

    prompt: str | list[int | str]
    max_tokens: int | None = 16


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``/tokenize``: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


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
    except (msgspec.DecodeError, msgspec.ValidationError, TemplateError) as exc:
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
        tokens = apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt)
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
    _check_model(engine.config, body.model)
    prompt = _prompt_override(body.kv_transfer_params)
    if prompt is None:
        prompt = apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt)
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    return await _generate(request, engine, body, prompt, max_tokens, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI (legacy) completion."""
    engine = _engine(request)
    body = _decode_body(CompletionRequest, await request.read())
    _check_model(engine.config, body.model)
    prompt = _prompt_override(body.kv_transfer_params)
    if prompt is None:
        if isinstance(body.prompt, str):
            prompt = encode(body.prompt)
        elif all(isinstance(p, int) for p in body.prompt):
            prompt = [int(p) for p in body.prompt]
        elif len(body.prompt) == 1 and isinstance(body.prompt[0], str):
            prompt = encode(body.prompt[0])
        else:
            raise InvalidRequest("Batched prompts are not supported by the emulator.")
    return await _generate(request, engine, body, prompt, body.max_tokens, chat=False)


def _prompt_override(params: dict[str, Any] | None) -> list[int] | None:
    """``kv_transfer_params.prompt_token_ids``: the prompt, templating skipped."""
    if not params or params.get("prompt_token_ids") is None:
        return None
    try:  # a typed conversion checks every id in C (and copies the list)
        return msgspec.convert(params["prompt_token_ids"], list[int])
    except msgspec.ValidationError:
        raise InvalidRequest("kv_transfer_params.prompt_token_ids must be token ids.") from None


async def _generate(
    request: web.Request,
    engine: Engine,
    body: _Common,
    prompt: list[int],
    max_tokens: int | None,
    *,
    chat: bool,
) -> web.StreamResponse:
    if body.n not in (None, 1):
        raise InvalidRequest("The emulator supports n=1 only.")
    if max_tokens is None:
        max_tokens = max(engine.config.max_model_len - len(prompt), 1)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    session_id = body.session_id or request.headers.get("X-Session-ID")
    spec = GenerationSpec(
        request_id=request_id,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        kv_transfer_params=body.kv_transfer_params,
        session_id=session_id,
    )
    running = await engine.submit(spec)
    engine.metrics.num_requests_running.inc()
    shape = _Shape(engine.config.model, request_id, chat, body, running)
    try:
        if body.stream:
            return await _stream(request, shape)
        return await _complete(shape)
    finally:
        running.abort()
        engine.metrics.num_requests_running.dec()


class _Shape:
    """Builds OpenAI objects for one request."""

    def __init__(
        self, model: str, request_id: str, chat: bool, body: _Common, running: RunningRequest
    ) -> None:
        self.model = model
        self.request_id = request_id
        self.chat = chat
        self.body = body
        self.running = running
        self.created = int(time.time())

    def headers(self) -> dict[str, str]:
        stats = self.running.stats
        return {
            "X-Request-Id": self.request_id,
            "X-Kvferry-Emulator-Pull": stats.pull,
            "X-Kvferry-Emulator-Cached-Tokens": str(stats.local_cached_tokens),
            "X-Kvferry-Emulator-Pulled-Tokens": str(stats.pulled_tokens),
            "X-Kvferry-Emulator-Computed-Tokens": str(stats.computed_tokens),
        }

    def text(self, tokens: list[int]) -> str:
        return decode(tokens, skip_special_tokens=self.body.skip_special_tokens)

    def usage(self) -> dict[str, Any]:
        stats = self.running.stats
        completion = len(self.running.output_token_ids)
        return {
            "prompt_tokens": stats.prompt_tokens,
            "total_tokens": stats.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": stats.local_cached_tokens + stats.pulled_tokens},
        }

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.request_id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(self, tokens: list[int], finish_reason: str | None, delta: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
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
        return choice

    def prompt_token_ids(self) -> list[int] | None:
        if not self.body.return_token_ids:
            return None
        return list(self.running.spec.prompt_token_ids)

    def extras(self, body: dict[str, Any]) -> None:
        if self.running.spec.session_id is not None:
            body["session_id"] = self.running.spec.session_id


async def _complete(shape: _Shape) -> web.Response:
    running = shape.running
    async for _token, _last in running.tokens():
        pass
    choice = shape.choice(running.output_token_ids, running.finish_reason, delta=False)
    if not shape.chat and shape.body.return_token_ids:
        choice["prompt_token_ids"] = shape.prompt_token_ids()
    body = shape.envelope([choice], chunk=False)
    body["usage"] = shape.usage()
    body["prompt_logprobs"] = None
    body["prompt_token_ids"] = shape.prompt_token_ids()
    body["kv_transfer_params"] = running.kv_transfer_params
    shape.extras(body)
    return json_response(body, headers=shape.headers())


async def _stream(request: web.Request, shape: _Shape) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **shape.headers(),
        }
    )
    await response.prepare(request)

    async def send(payload: dict[str, Any] | bytes) -> None:
        data = payload if isinstance(payload, bytes) else _json_encode(payload)
        await response.write(b"data: " + data + b"\n\n")

    first: dict[str, Any]
    if shape.chat:
        first = shape.envelope(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            chunk=True,
        )
        if shape.body.return_token_ids:
            first["prompt_token_ids"] = shape.prompt_token_ids()
        await send(first)
    include_usage = bool(shape.body.stream_options and shape.body.stream_options.include_usage)
    try:
        await _stream_tokens(shape, send)
    except EngineError as exc:
        # As vLLM: a failure once the stream started is an error event, then the stream's end.
        log.warning("http.stream.failed", path=request.path, status=int(exc.status), error=str(exc))
        await send(error_body(exc.status, str(exc)))
        include_usage = False
    if include_usage:
        tail = shape.envelope([], chunk=True)
        tail["usage"] = shape.usage()
        await send(tail)
    await send(b"[DONE]")
    await response.write_eof()
    return response


async def _stream_tokens(shape: _Shape, send: Callable[[dict[str, Any] | bytes], Awaitable[None]]) -> None:
    running = shape.running
    sent_first = shape.chat
    async for token, last in running.tokens():
        reason = running.finish_reason if last else None
        chunk = shape.envelope([shape.choice([token], reason, delta=True)], chunk=True)
        if not sent_first and shape.body.return_token_ids:
            chunk["prompt_token_ids"] = shape.prompt_token_ids()
        sent_first = True
        if last:
            if running.kv_transfer_params is not None:
                chunk["kv_transfer_params"] = running.kv_transfer_params
            shape.extras(chunk)
        await send(chunk)


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving one engine."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/emulator/state", emulator_state)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    return app

"""vLLM's OpenAI-compatible HTTP surface over an emulated engine (aiohttp).

Routes: ``/v1/chat/completions``, ``/v1/completions`` (SSE or JSON),
``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``,
``/metrics``, ``/reset_prefix_cache`` and the emulator-only ``/emulator/state``.

Handlers parse and validate (``emulator.api_requests``), call the engine, and shape the
answer (as JSON: ``emulator.api_answers``; as SSE: ``emulator.api_streams``); domain
errors become vLLM's ``{"error": {...}}`` bodies in one middleware. A JSON answer
carries ``kv_transfer_params`` at the top level; a stream's final chunk (the one with
``finish_reason``) only with ``stream_kv_transfer_params`` (vLLM PR 40186; 0.32 streams
carry none). A request refused before admission that came with a
prefill's params (``do_remote_prefill``) has the engine tell their holder to free the
blocks, as vLLM's serving layer does (PR 41269); nothing is kept for it here. Each answer has
``X-Kvferry-Emulator-*`` headers telling where the prompt's KV came from.

``n`` > 1 and batched completion prompts run one engine request per sequence, as
vLLM does, and answer with one choice per sequence (``prompt_index * n + i``).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from emulator.api_answers import Answer, Shape, complete, complete_many, json_response
from emulator.api_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    check_model,
    completion_prompts,
    decode_body,
    num_sequences,
    sequence_ids,
)
from emulator.api_streams import stream, stream_failed
from emulator.config import VLLM_VERSION
from emulator.engine import Engine
from emulator.errors import EngineError, InvalidRequest, KVLoadFailed, ModelNotFound, error_body
from emulator.prompts import forwarded_prompt_ids
from emulator.sequence import GenerationSpec
from emulator.tokenizer import VOCAB_SIZE, TemplateError, apply_chat_template, decode, encode
from kvferry.decoding import UNDECODABLE

log = structlog.get_logger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)

_BAD_REQUEST: tuple[type[Exception], ...] = (*UNDECODABLE, TemplateError)
"""A body that does not decode (or nests too deep), or a chat template that fails on it."""


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
    body = decode_body(TokenizeRequest, await request.read())
    check_model(engine.config, body.model)
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
    body = decode_body(DetokenizeRequest, await request.read())
    check_model(engine.config, body.model)
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
    body = decode_body(ChatCompletionRequest, await request.read())
    with _rejection_cleanup(engine, body):
        return await _chat(request, engine, body)


async def _chat(request: web.Request, engine: Engine, body: ChatCompletionRequest) -> web.StreamResponse:
    check_model(engine.config, body.model)
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
    body = decode_body(CompletionRequest, await request.read())
    with _rejection_cleanup(engine, body):
        if body.stream and body.use_beam_search:  # (vLLM's first check, before the model's)
            raise InvalidRequest("Streaming is not currently supported with beam search")
        if body.use_beam_search:
            raise InvalidRequest("The emulator does not do beam search.")
        return await _completion(request, engine, body)


async def _completion(request: web.Request, engine: Engine, body: CompletionRequest) -> web.StreamResponse:
    check_model(engine.config, body.model)
    # (kv_transfer_params.prompt_token_ids is not the prompt here, in vLLM neither)
    prompts = completion_prompts(body.prompt)
    return await _generate(request, engine, body, prompts, body.max_tokens, chat=False)


@contextlib.contextmanager
def _rejection_cleanup(engine: Engine, body: GenerationRequest) -> Iterator[None]:
    """A request refused before the engine admitted it (a bad model, prompt or setting)
    that came with a prefill's params: the engine tells their holder to free the blocks,
    as vLLM's ``_with_kv_transfer_rejection_cleanup`` does (PR 41269)."""
    try:
        yield
    except (InvalidRequest, ModelNotFound):
        engine.pulls.kv_transfer_rejected(body.kv_transfer_params)
        raise


async def _generate(
    request: web.Request,
    engine: Engine,
    body: GenerationRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    *,
    chat: bool,
) -> web.StreamResponse:
    n = num_sequences(body)
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
        for k, sequence_id in enumerate(sequence_ids(internal, len(prompts), n, chat))
    ]
    if len(specs) > 1:  # (n > 1, or a batch of prompts: choice k is sequence k, of prompt k // n)
        if len(specs) > engine.pool.num_blocks:  # each holds a block of its own at least
            raise InvalidRequest(f"{len(specs)} sequences need more KV blocks than the engine has.")
        for spec in specs:  # a bad one refused before any other is prefilled
            engine.validate(spec)
    answer = Answer(
        request_id, engine.config.model, chat, body, int(time.time()), request.headers.get("X-Request-Id", "")
    )
    shapes: list[Shape] = []
    try:
        for spec in specs:  # one engine request each, as vLLM runs them, prefilled in turn
            running = await engine.submit(spec)
            engine.metrics.num_requests_running.inc()
            shapes.append(Shape(answer, running, len(shapes)))
        if body.stream:
            return await stream(request, answer, shapes, n)
        return await (complete(shapes[0]) if len(shapes) == 1 else complete_many(shapes, n))
    except KVLoadFailed as exc:  # (raised by a prefill: a stream handles its own failures)
        if not body.stream:
            raise
        return await stream_failed(request, exc, answer, [spec.prompt_token_ids for spec in specs])
    finally:
        for shape in shapes:
            shape.running.abort()
            engine.metrics.num_requests_running.dec()


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

"""The OpenAI-compatible HTTP surface (aiohttp). Thin handlers: validate, hand off, answer.

Routes: ``/v1/chat/completions`` and ``/v1/completions`` (streaming or not, one
`router.turn.Turn` each), ``/v1/models`` (merged from a prefill node per model),
``/health`` (200 while there is a prefill and a decode node to route to),
``/version`` (vLLM's: the engines' version), ``DELETE /v1/conversations/{id}`` (a
conversation's end: `router.conversations`),
``/metrics`` (Prometheus). Bad client input gets vLLM's 400 error shape. With API
keys set, /v1/ routes answer 401 to a client without one of them, as vLLM does.

Every ``X-Kvferry-*`` header a client sends is dropped before anything reads it
(they are kvferry's own), and a request's tenant is the one its API key names
(`router.identity.ApiKeys`), set on the request for the handlers (`TENANT`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict

from kvferry import __version__ as KVFERRY_VERSION
from kvferry.decoding import UNDECODABLE, lax_bool
from kvferry.security import audit
from kvferry.security.roles import anonymous
from kvferry.security.tls import peer_identity_from_transport
from kvferry.serving import guard_middleware
from kvferry.turnheaders import internal_header
from router import conversations
from router.choice import Node, prefill_candidates
from router.decisions import Failure, FailureKind
from router.errors import bad_gateway, error_response
from router.identity import ApiKeys, api_key_of
from router.turn import Shared, Turn
from router.upstream import Reply, UpstreamError

log = structlog.get_logger(__name__)

SHARED_KEY = web.AppKey("shared", Shared)
TENANT = web.RequestKey("tenant", str)
"""The tenant of a /v1/ request, as its API key names it ("" = the daemon's default)."""
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_decode = msgspec.json.Decoder().decode
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bad_request(message: str) -> web.Response:
    return error_response(400, message, "BadRequestError")


#: Flags the router or D's sidecar read themselves: given as vLLM would take them (see
#: `lax_bool`), they go on as true booleans, so every reader downstream agrees on them.
_FLAGS = ("stream", "echo", "return_token_ids")


def input_problem(path: str, body: Any) -> str | None:
    """What is wrong with a generation request body (None: nothing the router must refuse).

    Flags given as strings or numbers vLLM accepts are made booleans in `body`."""
    if not isinstance(body, dict):
        return "The request body must be a JSON object."
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' is required: a non-empty list of messages."
        if not all(isinstance(m, dict) for m in messages):
            return "Each message must be an object."
    elif body.get("prompt") in (None, "", []) and body.get("prompt_embeds") is None:
        return "'prompt' (or 'prompt_embeds') is required."
    for flag in _FLAGS:
        if body.get(flag) is not None:
            try:
                body[flag] = lax_bool(body[flag])
            except ValueError:
                return f"'{flag}' must be a boolean."
    return None


@web.middleware
async def count_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count answers by endpoint and status; a router bug answers 500 (never a traceback)."""
    shared = request.app[SHARED_KEY]
    try:
        response = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own 404 / 405 / 413, as JSON errors like every other answer here.
        response = error_response(e.status, e.reason, e.reason.title().replace(" ", "") + "Error")
        if "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
    except Exception:
        log.exception("router.handler.crashed", path=request.path)
        response = error_response(500, "internal router error", "InternalServerError")
    # Labelled by route, not by path: a client's made-up paths must not make label values.
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    shared.metrics.requests.labels(endpoint, str(response.status)).inc()
    return response


@web.middleware
async def internal_headers_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Drop every ``X-Kvferry-*`` header a client sent: those are kvferry's own (a tenant
    named by a client would reach another tenant's conversations)."""
    if any(map(internal_header, request.headers)):
        kept = CIMultiDict((k, v) for k, v in request.headers.items() if not internal_header(k))
        request = request.clone(headers=kept)
    return await handler(request)


def auth_middleware(keys: ApiKeys) -> Middleware:
    """The tenant of each /v1/ request, from its API key; a key `keys` do not take (with
    keys configured, none too) gets 401, as vLLM's --api-key check answers, and an audit
    line (`kvferry.security.audit`)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            key = api_key_of(request.headers)
            tenant = keys.tenant_of(key)
            if tenant is None:
                why = "an API key of the router's is needed" if key else "no API key given"
                audit.denied(None, f"{request.method} {request.path}", anonymous(why), request.remote or "")
                return web.json_response({"error": "Unauthorized"}, status=401)
            request[TENANT] = tenant
        return await handler(request)

    return check


async def _generate(request: web.Request, path: str) -> web.StreamResponse:
    timeout_s = request.app[SHARED_KEY].settings.server.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        response = error_response(408, f"request body not received within {timeout_s:g} s", "RequestTimeout")
        response.force_close()  # (the rest of the body may still come)
        return response
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, e.text or "Request body too large.", "BadRequestError")
    except web.RequestPayloadError as e:  # (not what its Content-Encoding says: a 500 it was)
        return bad_request(f"The request body does not decode: {e}")
    try:
        body = _decode(raw) if raw else None
    except UNDECODABLE as e:
        return bad_request(f"Invalid JSON in the request body: {e}")
    problem = input_problem(path, body)
    if problem is not None:
        return bad_request(problem)
    assert isinstance(body, dict)
    return await Turn(request.app[SHARED_KEY], request, path, body, request[TENANT]).serve()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT_PATH)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS_PATH)


async def end_conversation(request: web.Request) -> web.Response:
    return await conversations.end_conversation(request, request.app[SHARED_KEY], request[TENANT])


async def models(request: web.Request) -> web.Response:
    """The model cards of every model served: a prefill node's answer per base model,
    merged (one model: that node's answer as it is). A model none of whose prefill
    nodes answers cannot be served now, and is left out."""
    shared = request.app[SHARED_KEY]
    by_model: dict[str, list[Node]] = {}
    for node in prefill_candidates(shared.directory.nodes):
        # (a node whose model is not known yet stands for itself: it may serve any model)
        by_model.setdefault(node.model or node.engine_id, []).append(node)
    if not by_model:
        return error_response(503, "no prefill node available", "ServiceUnavailableError")
    headers = shared.engines.headers(request.headers, f"kvf-{uuid.uuid4().hex}")

    async def cards_of(nodes: list[Node]) -> Reply | UpstreamError:
        """The model's cards from the first of its prefill nodes that answers, least loaded
        first. A 4xx is the client's (its key, say): the next node would answer alike."""
        answer: Reply | UpstreamError = UpstreamError(Failure(FailureKind.CONNECT), "no node")
        for node in sorted(nodes, key=lambda n: shared.load.view.get(n.engine_id, 0)):
            try:
                answer = await shared.engines.get(node.url + "/v1/models", headers)
            except UpstreamError as e:
                answer = e
            if isinstance(answer, Reply) and answer.status < 500:
                break
        return answer

    replies = await asyncio.gather(*(cards_of(nodes) for nodes in by_model.values()))
    good = [r for r in replies if isinstance(r, Reply) and r.status == 200]
    if len(replies) == 1 or not good:
        reply = replies[0]
        if isinstance(reply, UpstreamError):
            return bad_gateway(f"models: {reply}")
        return web.Response(body=reply.body, status=reply.status, content_type="application/json")
    cards: dict[str, Any] = {}
    for reply in good:
        answer = reply.json()
        data = answer.get("data") if isinstance(answer, dict) else None
        for card in data if isinstance(data, list) else []:
            if isinstance(card, dict) and isinstance(card.get("id"), str):
                cards.setdefault(card["id"], card)
    return web.json_response({"object": "list", "data": list(cards.values())})


#: Nodes asked for their version before the router answers with its own.
_VERSION_ASKED = 3


def version_of(answer: Any) -> str:
    """The version in a vLLM /version answer ("" = none)."""
    v = answer.get("version") if isinstance(answer, dict) else None
    return v if isinstance(v, str) and v else ""


async def version(request: web.Request) -> web.Response:
    """vLLM's ``GET /version`` (its benchmarks ask for it): ``{"version": ...}``, the version
    of the engines behind the router as the least loaded node that answers reports it
    (what a client asking compares against is the engine serving it), else kvferry's own;
    ``kvferry_version`` is the router's in every answer."""
    shared = request.app[SHARED_KEY]
    headers = shared.engines.headers(request.headers, f"kvf-{uuid.uuid4().hex}")
    timeout_s = shared.settings.upstream.health_timeout_s
    nodes = sorted(shared.directory.nodes, key=lambda n: shared.load.view.get(n.engine_id, 0))
    engines = ""
    for node in nodes[:_VERSION_ASKED]:
        try:
            reply = await shared.engines.get(node.url + "/version", headers, timeout_s)
        except UpstreamError:
            continue
        engines = version_of(reply.json()) if reply.status == 200 else ""
        if engines:
            break
    return web.json_response({"version": engines or KVFERRY_VERSION, "kvferry_version": KVFERRY_VERSION})


async def health(request: web.Request) -> web.Response:
    nodes = request.app[SHARED_KEY].directory.nodes
    ok = any(n.prefills for n in nodes) and any(n.decodes for n in nodes)
    return web.Response(status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics. Over HTTPS (secure mode) only to a caller whose client
    certificate the CA signed (Prometheus with its scrape certificate): clients with an
    API key have no business reading the whole deployment's traffic figures."""
    if request.secure and peer_identity_from_transport(request.transport) is None:
        denial = anonymous("/metrics needs a client certificate of the deployment's CA")
        audit.denied(None, "GET /metrics", denial, request.remote or "")
        return web.json_response({"error": denial.message}, status=401)
    payload, content_type = request.app[SHARED_KEY].metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


def build_app(shared: Shared, keys: ApiKeys) -> web.Application:
    """The router's routes, behind its middlewares; `keys` are the API keys it takes."""
    server = shared.settings.server
    middlewares = [guard_middleware, count_middleware, internal_headers_middleware, auth_middleware(keys)]
    app = web.Application(middlewares=middlewares, client_max_size=server.max_body_bytes)
    app[SHARED_KEY] = shared
    app.router.add_post(CHAT_PATH, chat_completions)
    app.router.add_post(COMPLETIONS_PATH, completions)
    app.router.add_get("/v1/models", models)
    app.router.add_delete(conversations.PATH, end_conversation)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    return app

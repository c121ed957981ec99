"""The tap's gate: every request passes here before it is answered or proxied.

It refuses, with a JSON error, a target not in origin form (400), a path the tap does
not serve (404), a method the path does not take (405) and an administrative path from
a caller without the admin role (in development mode every caller is admin: allowed);
the decisions are `sidecar.paths`'. It tells the connection's `HeadGuard` when a
request's head is in and when its handler is done, and answers a `BodyRefused` raised
by a handler with its status.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from sidecar.bodies import BodyRefused
from sidecar.paths import Access, Refusal, Route, route_of
from sidecar.serving import guard_of

log = structlog.get_logger(__name__)

ROUTE_KEY = web.RequestKey("kvferry_route", Route)
"""The route `sidecar.paths` found for a request the gate let through."""


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error, on a connection closed after it when the body may be unread."""
    kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def _refused(request: web.Request, refusal: Refusal) -> web.Response:
    log.info("tap.refused", status=refusal.status, method=request.method, reason=refusal.message)
    return error_response(
        refusal.status, refusal.message, {"Allow": refusal.allow} if refusal.allow else None
    )


@web.middleware
async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what the tap does not serve, pass the rest to `handler`."""
    guard = guard_of(request)
    if guard is not None:
        guard.head_received()
    try:
        route = route_of(request.method, request.raw_path)
        if isinstance(route, Refusal):
            return _closing(_refused(request, route))
        if route.access is Access.ADMIN:
            log.info("audit.allowed", caller="development", path=request.path, method=request.method)
        request[ROUTE_KEY] = route
        try:
            return await handler(request)
        except BodyRefused as e:
            log.info("tap.body.refused", status=e.status, path=request.path, reason=e.message)
            retry = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return _closing(error_response(e.status, e.message, retry))
    finally:
        if guard is not None:
            guard.request_done()


def _closing(resp: web.Response) -> web.Response:
    """`resp` with the connection closed after it (a body the tap did not read may follow)."""
    resp.force_close()
    return resp

"""The tap's gate: every request passes here before its body is read, answered or proxied.

It refuses, with a JSON error, a target not in origin form (400), a path the tap does
not serve (404), a method the path does not take (405) (the decisions are
`sidecar.paths`'), a caller without an identity (401) or without the role the path needs
(403), and a tenant its caller may not name (403) (`sidecar.access`'); each refusal of a
caller is an audit line, as is each administrative call let through. It answers a
`BodyRefused` raised by a handler with its status. (The connection's `HeadGuard` is told
of each request by `kvferry.serving.guard_middleware`, before the gate, as in the router.)
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvferry.security import audit
from kvferry.security.policy import Policy
from kvferry.security.roles import Denial
from kvferry.security.tls import bearer_token, peer_identity_from_transport
from sidecar.access import caller_of, path_denial, tenant_of
from sidecar.bodies import BodyRefused
from sidecar.paths import Access, Refusal, Route, route_of

log = structlog.get_logger(__name__)

ROUTE_KEY = web.RequestKey("kvferry_route", Route)
"""The route `sidecar.paths` found for a request the gate let through."""
TOKEN_USED_KEY = web.RequestKey("kvferry_token_used", bool)
"""The request's bearer token named its caller: not for the engine."""
_STATUS = {"unauthenticated": 401, "permission_denied": 403}


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def _refused(request: web.Request, refusal: Refusal) -> web.Response:
    log.info("tap.refused", status=refusal.status, method=request.method, reason=refusal.message)
    return error_response(
        refusal.status, refusal.message, {"Allow": refusal.allow} if refusal.allow else None
    )


def gate(policy: Policy | None, tenant_header: str) -> Middleware:
    """The gate of a tap under `policy` (None: development mode)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = _refusal(request, policy, tenant_header)
        if refusal is not None:
            return _closing(refusal)
        try:
            return await handler(request)
        except BodyRefused as e:
            log.info("tap.body.refused", status=e.status, path=request.path, reason=e.message)
            retry = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return _closing(error_response(e.status, e.message, retry))

    return check


def _refusal(request: web.Request, policy: Policy | None, tenant_header: str) -> web.Response | None:
    """The answer to a request the tap refuses, or None (its route set on the request)."""
    route = route_of(request.method, request.raw_path)
    if isinstance(route, Refusal):
        return _refused(request, route)
    path = request.raw_path.partition("?")[0]
    token = bearer_token(request.headers.get("Authorization"))
    common_name = peer_identity_from_transport(request.transport)
    caller = caller_of(policy, common_name, token)
    action = f"{request.method} {path}"
    denial = path_denial(caller, route, request.method, path)
    if denial is None and not isinstance(caller, Denial):
        tenant = tenant_of(policy, caller, request.headers, tenant_header)
        denial = tenant if isinstance(tenant, Denial) else None
    if denial is not None:
        audit.denied(None if isinstance(caller, Denial) else caller, action, denial, request.remote or "")
        challenge = {"WWW-Authenticate": "Bearer"} if denial.code == "unauthenticated" else None
        return error_response(_STATUS[denial.code], denial.message, challenge)
    if route.access is Access.ADMIN and not isinstance(caller, Denial):
        audit.allowed(caller, action, request.remote or "")
    request[ROUTE_KEY] = route
    request[TOKEN_USED_KEY] = bool(policy and token and policy.by_certificate(common_name) is None)
    return None


def _closing(resp: web.Response) -> web.Response:
    """`resp` with the connection closed after it (a body the tap did not read may follow)."""
    resp.force_close()
    return resp

"""The client's error answers, shaped as vLLM shapes them: an engine's own 4xx passed on as
it came, a failed or unreachable engine as a 502 that says which and why."""

from __future__ import annotations

from aiohttp import web

from router.decisions import Failure, FailureKind
from router.upstream import Reply, encode


def error_response(status: int, message: str, kind: str) -> web.Response:
    """A vLLM-shaped error answer."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(body=encode(body), status=status, content_type="application/json")


def bad_gateway(message: str) -> web.Response:
    return error_response(502, message, "BadGatewayError")


def passthrough(reply: Reply) -> web.Response:
    """An engine's 4xx answer, as the engine gave it."""
    if reply.json() is not None:
        return web.Response(body=reply.body, status=reply.status, content_type="application/json")
    text = reply.body.decode(errors="replace")[:2000] or f"engine answered {reply.status}"
    return error_response(reply.status, text, "BadRequestError" if reply.status == 400 else "EngineError")


def engine_message(reply: Reply | None, failure: Failure, role: str) -> str:
    detail = ""
    if reply is not None:
        obj = reply.json()
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            detail = err["message"]
        elif reply.body:
            detail = reply.body.decode(errors="replace")[:500]
    what = f"status {failure.status}" if failure.kind is FailureKind.STATUS else failure.kind.value
    return f"{role} engine failed ({what}){': ' + detail if detail else ''}"

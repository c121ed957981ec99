"""Who calls: one server interceptor identifies every caller and checks its role for the
method; the handlers then check what a request names (a tenant, a node) with `require`.

A caller is the Common Name of its verified client certificate, or the identity whose
token digest the policy lists for an `authorization: Bearer <token>` header
(kvferry.security.policy.identify). Without a policy (development mode) every caller is
the development admin and the interceptor adds nothing to a call.

A refused call ends UNAUTHENTICATED (no identity, or one the policy does not know) or
PERMISSION_DENIED (the role does not allow the method), with the message of
kvferry.security.roles, and leaves one `audit.denied` line. An allowed call runs with its
caller in a context variable (`caller()`), which the tasks it starts inherit (the ops of a
Leases/Stream).
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from controlplane.errors import PermissionDenied
from kvferry.security import audit
from kvferry.security.policy import Policy, identify
from kvferry.security.roles import Caller, Denial, method_denial
from kvferry.security.tls import bearer_token, peer_identity_from_grpc

_STATUS = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
}


@dataclass(frozen=True)
class Admitted:
    """The caller a call runs as, and where it came from (for the audit lines)."""

    caller: Caller
    peer: str = ""


_ADMITTED: contextvars.ContextVar[Admitted] = contextvars.ContextVar(
    "kvferry_caller",
    default=Admitted(Caller.DEVELOPMENT),  # noqa: B039 - frozen
)


def caller() -> Caller:
    """Whom the current call runs as (development mode: the development admin)."""
    return _ADMITTED.get().caller


def require(denial: Denial | None, action: str) -> None:
    """Raise PermissionDenied (after its audit line) when a per-request check refused."""
    if denial is None:
        return
    admitted = _ADMITTED.get()
    audit.denied(admitted.caller, action, denial, admitted.peer)
    raise PermissionDenied(denial.message)


def allowed(action: str, **details: object) -> None:
    """Record an administrative act the current caller was allowed (a revoke, a deregister)."""
    admitted = _ADMITTED.get()
    audit.allowed(admitted.caller, action, admitted.peer, **details)


def _token(details: grpc.HandlerCallDetails) -> str:
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            return bearer_token(value if isinstance(value, str) else value.decode(errors="replace"))
    return ""


class Authenticator(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """The one check every RPC passes: identify the caller, allow its role the method."""

    def __init__(self, policy: Policy | None) -> None:
        self._policy = policy

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        """The call's handler, wrapped to admit its caller first (the peer's certificate is
        known only to the handler's context, so the check runs there)."""
        handler = await continuation(details)
        if handler is None or self._policy is None:
            return handler
        method, token = details.method, _token(details)
        return _wrapped(handler, lambda context: self._admit(method, token, context))

    async def _admit(self, method: str, token: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        denial = admission(self._policy, method, token, peer_identity_from_grpc(context), context.peer())
        if denial is not None:
            await context.abort(status_code(denial), denial.message)


def admission(
    policy: Policy | None, method: str, token: str, common_name: str | None, peer: str
) -> Denial | None:
    """Identify a caller (its bearer `token`, else its certificate's `common_name`) and allow
    its role `method`: None, the caller then set for the current context and the tasks it
    starts (`caller()`); or the Denial, its audit line written."""
    who = identify(policy, token, common_name)
    known = who if isinstance(who, Caller) else None
    denial = method_denial(known, method)
    if denial is not None:
        if isinstance(who, Denial):  # (says what the identity lacked, not just "none")
            denial = who
        audit.denied(known, method, denial, peer)
        return denial
    _ADMITTED.set(Admitted(known or Caller.DEVELOPMENT, peer))
    return None


def status_code(denial: Denial) -> grpc.StatusCode:
    """The gRPC status a refused call ends with."""
    return _STATUS[denial.code]


Admit = Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]


def _wrapped(handler: Any, admit: Admit) -> Any:
    """`handler` (a grpc.RpcMethodHandler) admitting its caller before it runs."""
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(context)
            return await unary(request, context)

        return handler._replace(unary_unary=unary_unary)
    if handler.stream_stream is not None:
        streaming = handler.stream_stream

        async def stream_stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await admit(context)
            async for response in streaming(requests, context):
                yield response

        return handler._replace(stream_stream=stream_stream)
    if handler.unary_stream is not None:  # (reflection and health's Watch)
        producing = handler.unary_stream

        async def unary_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await admit(context)
            async for response in producing(request, context):
                yield response

        return handler._replace(unary_stream=unary_stream)
    streamed = handler.stream_unary

    async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await admit(context)
        return await streamed(requests, context)

    return handler._replace(stream_unary=stream_unary)

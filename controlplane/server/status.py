"""The one map from the daemon's errors to gRPC status codes (`status_of`), and its two
uses: ending a call with it (`abort`; `refuse` in the `rpc` decorator every unary handler
wears) and answering one op of a Leases/Stream (`fill_op_error`). Cancellation and deadlines pass
through untouched: they are not errors of the daemon's."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from controlplane import metrics
from controlplane.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    KvferryError,
    NotApplied,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StoreUnavailable,
)
from kvferry.v1 import leases_pb2

log = structlog.get_logger(__name__)

#: ABORTED proves nothing was applied (sending it again is safe); UNAVAILABLE leaves open
#: whether etcd applied it (the contract is in leases.proto, OpError).
_STATUS: dict[type[KvferryError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotApplied: grpc.StatusCode.ABORTED,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    Conflict: grpc.StatusCode.ABORTED,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]


def status_of(error: Exception, where: str) -> tuple[grpc.StatusCode, str]:
    """The status a caller gets for `error`, raised while serving `where` (an RPC's name).
    A domain error gives its code and message; anything else is a defect: logged, and
    answered INTERNAL without its details."""
    if isinstance(error, KvferryError):
        for cls in type(error).__mro__:
            if cls in _STATUS:
                return _STATUS[cls], str(error)
    log.error("rpc.failed", method=where, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error in {where}"


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: Exception, where: str) -> NoReturn:
    """End the call with the status of `error` (see `status_of`)."""
    code, message = status_of(error, where)
    await context.abort(code, message)
    raise AssertionError("unreachable")  # (abort raises)


def refuse(context: grpc.aio.ServicerContext[Any, Any], error: Exception, where: str) -> None:
    """Set the status of `error` on a call whose handler then returns without an answer.

    Not `abort`'s raise: grpc keeps the AbortError in a reference cycle with the frames it
    went through, and with them the request, which only a full garbage collection frees
    (4 MiB requests refused one after another kept 12 MiB each: +450 MiB after a hundred,
    tests/fuzz/test_grpc.py)."""
    code, message = status_of(error, where)
    context.set_code(code)
    context.set_details(message)


def fill_op_error(out: leases_pb2.OpError, error: Exception, where: str) -> None:
    """One op of a stream failed: its result carries the status the unary call would end with."""
    code, message = status_of(error, where)
    out.code, out.message = code.value[0], message


def rpc(method: str) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    """Map errors to status codes (`status_of`) and time the handler."""

    def wrap(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
        hist = metrics.RPC_LATENCY.labels(method)

        @functools.wraps(fn)
        async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext[Req, Resp]) -> Resp:
            start = time.perf_counter()
            try:
                return await fn(self, request, context)
            except Exception as e:
                refuse(context, e, method)
            finally:
                hist.observe(time.perf_counter() - start)
            return None  # type: ignore[return-value]  # (the status is the answer)

        return handler

    return wrap

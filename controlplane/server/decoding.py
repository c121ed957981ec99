"""A kvferry request message that does not decode (bad UTF-8, nesting too deep...) gets
INVALID_ARGUMENT naming the problem, not gRPC's UNKNOWN: a server interceptor swaps each
kvferry.v1 handler's deserializer for one that never raises."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from controlplane.errors import InvalidArgument
from controlplane.server.inbox import close_requests
from controlplane.server.status import abort


class _Undecodable:
    """A request message that did not parse (what the tolerant deserializer returns)."""

    def __init__(self, error: Exception) -> None:
        self.message = f"the request message does not decode: {error}"


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # (protobuf's DecodeError: bad UTF-8, nesting too deep, ...)
            return _Undecodable(e)

    return deserialize


class DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """A kvferry request that does not decode gets INVALID_ARGUMENT; on a stream, the
    handler sees InvalidArgument raised where the message would be (Leases/Stream still
    answers the ops it is running: a claim etcd applied keeps its answer)."""

    def __init__(self) -> None:
        self._guarded: dict[int, tuple[Any, Any]] = {}  # id(handler) -> (handler, guarded)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        """The call's handler; a kvferry.v1 one guarded (once per handler, then reused)."""
        # (continuation every time: an interceptor after this one runs on every call)
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/kvferry.v1."):
            return handler
        known = self._guarded.get(id(handler))
        if known is None or known[0] is not handler:
            known = self._guarded[id(handler)] = (handler, _guard(handler, details.method))
        return known[1]


def _passing_bytes(serialize: Any) -> Any:
    """`serialize`, but a response that is bytes already (encoded by its handler: see
    controlplane.server.stream) goes as it is."""

    def serialized(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serialized


def _guard(handler: Any, method: str) -> Any:
    """`handler` (a grpc.RpcMethodHandler) with the tolerant deserializer."""
    deserialize = _tolerant(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await abort(context, InvalidArgument(request.message), method)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
    if handler.stream_stream is not None:
        streaming = handler.stream_stream

        async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            try:
                async for request in requests:
                    if isinstance(request, _Undecodable):
                        raise InvalidArgument(request.message)
                    yield request
            finally:
                await close_requests(requests)

        async def stream_stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async for response in streaming(checked(requests), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, _passing_bytes(serialize))
    return handler  # (kvferry.v1 has no other kind)

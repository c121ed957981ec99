"""gRPC servicers: validate the message shape, call one ControlPlane operation,
map errors, build the reply. Nothing else lives here.

Domain errors become gRPC status codes in one place (`_STATUS` / `_rpc`);
cancellation and deadlines pass through untouched.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from controlplane import metrics
from controlplane.blockindex import IndexUpdate
from controlplane.cluster import Cluster
from controlplane.convert import apply_handout
from controlplane.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    KvferryError,
    NotFound,
    StoreUnavailable,
)
from controlplane.messages import (
    fill_lookup_response,
    lease_message,
    lookup_query_of,
    node_message,
    prompt_of,
    registration_of,
    retention_registration_of,
)
from controlplane.peers import Peers
from controlplane.policy import RELEASE, Prompt
from controlplane.records import NodeRecord, NodeState
from controlplane.service import ControlPlane
from controlplane.service.nodes import ListedNode
from kvferry.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from kvferry.framing import by_size
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc

log = structlog.get_logger(__name__)

_STATUS: dict[type[KvferryError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    Conflict: grpc.StatusCode.ABORTED,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext[Req, Resp]], Awaitable[Resp]]


def _status(e: KvferryError) -> grpc.StatusCode:
    for cls in type(e).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return grpc.StatusCode.INTERNAL


def _rpc(method: str) -> Callable[[Handler[Req, Resp]], Handler[Req, Resp]]:
    """Map domain errors to status codes and time the handler."""

    def wrap(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
        hist = metrics.RPC_LATENCY.labels(method)

        @functools.wraps(fn)
        async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext[Req, Resp]) -> Resp:
            start = time.perf_counter()
            try:
                return await fn(self, request, context)
            except KvferryError as e:
                await context.abort(_status(e), str(e))
                raise  # abort raises; this satisfies the type checker
            except Exception:
                log.exception("rpc.failed", method=method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}")
                raise
            finally:
                hist.observe(time.perf_counter() - start)

        return handler

    return wrap


class NodesServicer(nodes_pb2_grpc.NodesServicer):
    def __init__(self, cp: ControlPlane, cluster: Cluster) -> None:
        self._cp = cp
        self._cluster = cluster

    @_rpc("Nodes/Register")
    async def Register(
        self, request: nodes_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.RegisterNodeResponse:
        rec, restarted = await self._cp.registry.register(registration_of(request))
        node = node_message(ListedNode(NodeState(rec, True)))
        return nodes_pb2.RegisterNodeResponse(node=node, restarted=restarted)

    async def Attach(
        self,
        request_iterator: AsyncIterator[nodes_pb2.AttachRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[nodes_pb2.AttachResponse]:
        rec: NodeRecord | None = None
        stream = object()  # this stream, for the node's index to follow
        metrics.ATTACHED.inc()
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("body")
                if kind == "hello":
                    if rec is not None and msg.hello.engine_id != rec.engine_id:
                        raise InvalidArgument("an Attach stream speaks for one engine: open another")
                    rec = await self._cp.attachments.attach(msg.hello.engine_id, msg.hello.generation, stream)
                    ttl, rec = await self._cp.attachments.heartbeat(rec)
                    log.info("node.attached", engine_id=rec.engine_id, generation=rec.generation)
                    attached = node_message(ListedNode(NodeState(rec, True)))
                    yield nodes_pb2.AttachResponse(attached=attached, ttl_seconds=ttl)
                elif kind == "heartbeat":
                    if rec is None:
                        raise InvalidArgument("the first message on Attach must be hello")
                    beat = msg.heartbeat
                    self._cp.attachments.report(rec, beat.uncaptured_turns, beat.unretained_blocks, stream)
                    try:
                        ttl, rec = await self._cp.attachments.heartbeat(rec)
                    except StoreUnavailable as e:
                        # Keep the stream: the sidecar goes on heartbeating and liveness
                        # resumes when etcd is back.
                        log.warning("node.heartbeat.store_unavailable", engine_id=rec.engine_id, error=str(e))
                        ttl = 0
                    ack = nodes_pb2.Heartbeat(seq=beat.seq)
                    yield nodes_pb2.AttachResponse(heartbeat_ack=ack, ttl_seconds=ttl)
                elif kind == "kv_events":
                    if rec is None:
                        raise InvalidArgument("the first message on Attach must be hello")
                    b = msg.kv_events
                    self._cp.attachments.index_events(
                        rec, IndexUpdate(list(b.stored), list(b.removed), b.cleared, b.reset, b.seq), stream
                    )
                else:
                    raise InvalidArgument("Attach message has no body")
        except KvferryError as e:
            await context.abort(_status(e), str(e))
        finally:
            metrics.ATTACHED.dec()
            if rec is not None:
                self._cp.attachments.detach(rec, stream)
                log.info("node.detached", engine_id=rec.engine_id)

    @_rpc("Nodes/List")
    async def List(
        self, request: nodes_pb2.ListNodesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.ListNodesResponse:
        listed = await self._cluster.list_nodes(
            int(request.role), request.include_dead, request.local_only, context.time_remaining()
        )
        return nodes_pb2.ListNodesResponse(nodes=[node_message(n) for n in listed])

    @_rpc("Nodes/Score")
    async def Score(
        self, request: nodes_pb2.ScoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.ScoreResponse:
        scores = await self._cluster.score(
            list(request.block_hashes), int(request.role), request.local_only, context.time_remaining()
        )
        return nodes_pb2.ScoreResponse(
            scores=[nodes_pb2.NodeScore(engine_id=e, cached_blocks=n) for e, n in scores]
        )

    @_rpc("Nodes/Deregister")
    async def Deregister(
        self, request: nodes_pb2.DeregisterNodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.DeregisterNodeResponse:
        return nodes_pb2.DeregisterNodeResponse(found=await self._cp.registry.deregister(request.engine_id))


class LeasesServicer(leases_pb2_grpc.LeasesServicer):
    def __init__(self, cp: ControlPlane) -> None:
        self._cp = cp

    async def _register(self, request: leases_pb2.RegisterLeaseRequest) -> leases_pb2.RegisterLeaseResponse:
        view, replaced, release = await self._cp.retentions.register(retention_registration_of(request))
        # The stored retention without its params and digests: the caller just sent them.
        resp = leases_pb2.RegisterLeaseResponse(lease=lease_message(view, summary=True), replaced=replaced)
        if release is not None:
            apply_handout(release, RELEASE, resp.release_params)
        return resp

    async def _lookup(
        self,
        request: leases_pb2.LookupRequest,
        resp: leases_pb2.LookupResponse | None = None,
        later: asyncio.Future[leases_pb2.LookupPrompt] | None = None,
    ) -> leases_pb2.LookupResponse:
        """Answer a lookup into `resp` (a new message if None); `later` brings the prompt
        of a lookup sent with prompt_follows."""
        if request.prompt_follows and later is None:
            raise InvalidArgument("prompt_follows needs Leases/Stream (the prompt comes in a later op)")
        result = await self._cp.lookups.lookup(
            lookup_query_of(request), None if later is None else _prompt_of(later)
        )
        if resp is None:
            resp = leases_pb2.LookupResponse()
        fill_lookup_response(result, request.peek, resp)
        return resp

    @_rpc("Leases/Register")
    async def Register(
        self, request: leases_pb2.RegisterLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.RegisterLeaseResponse:
        return await self._register(request)

    @_rpc("Leases/Lookup")
    async def Lookup(
        self, request: leases_pb2.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.LookupResponse:
        return await self._lookup(request)

    async def Stream(
        self,
        request_iterator: AsyncIterator[leases_pb2.LeaseOpBatch],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[leases_pb2.LeaseOpResultBatch]:
        """Run each op as it arrives (up to STREAM_WINDOW at once); answer in completion
        order, the results that are ready going out together (`kvferry.framing`)."""
        ready: list[leases_pb2.LeaseOpResult] = []
        wake = asyncio.Event()
        taken = asyncio.Event()  # results were taken out to be sent
        window = asyncio.Semaphore(STREAM_WINDOW)
        running: set[asyncio.Task[None]] = set()
        # Lookups sent with prompt_follows, by op id, until their LookupPrompt op arrives.
        awaiting: dict[int, asyncio.Future[leases_pb2.LookupPrompt]] = {}
        prompt_at: dict[int, float] = {}
        reading = True

        def start_task(coro: Coroutine[Any, Any, None]) -> None:
            task = asyncio.create_task(coro)
            running.add(task)
            task.add_done_callback(running.discard)

        async def run(op: leases_pb2.LeaseOp, later: asyncio.Future[leases_pb2.LookupPrompt] | None) -> None:
            res = leases_pb2.LeaseOpResult(id=op.id)
            kind = op.WhichOneof("op")
            start = time.perf_counter()
            try:
                if kind == "register":
                    res.register.CopyFrom(await self._register(op.register))
                elif kind == "lookup":
                    await self._lookup(op.lookup, res.lookup, later)
                else:
                    raise InvalidArgument("LeaseOp has no op")
            except KvferryError as e:
                res.error.code, res.error.message = _status(e).value[0], str(e)
            except Exception:
                log.exception("rpc.failed", method=f"Leases/Stream.{kind}")
                res.error.code = grpc.StatusCode.INTERNAL.value[0]
                res.error.message = f"internal error in {kind}"
            finally:
                if later is None:
                    window.release()
                else:  # timed from its prompt: the wait before it is the caller's work
                    awaiting.pop(op.id, None)
                    start = prompt_at.pop(op.id, start)
                _STREAM_LATENCY[kind == "lookup"].observe(time.perf_counter() - start)
            ready.append(res)
            wake.set()

        def refuse(op_id: int, code: grpc.StatusCode, message: str) -> None:
            err = leases_pb2.LeaseOpResult(id=op_id)
            err.error.code, err.error.message = code.value[0], message
            ready.append(err)
            wake.set()

        def prompt_arrived(op: leases_pb2.LeaseOp) -> None:
            waiting = awaiting.get(op.id)
            if waiting is None or waiting.done():
                refuse(op.id, _INVALID, f"no lookup on this stream is waiting for a prompt with id {op.id}")
                return
            prompt_at[op.id] = time.perf_counter()
            waiting.set_result(op.prompt)

        broken: list[InvalidArgument] = []  # a request message that did not decode

        async def read() -> None:
            nonlocal reading
            try:
                try:
                    await read_ops()
                except InvalidArgument as e:  # stop reading; what runs still answers
                    broken.append(e)
                    for waiting in awaiting.values():  # no prompt will come: answer no_prompt
                        if not waiting.done():
                            waiting.set_result(leases_pb2.LookupPrompt())
                # (The request stream also ends this way when the client cancels the call:
                # lookups still waiting for a prompt then wait on, to be cancelled with the
                # call and have their claims put back, rather than answer and spend them.)
                while running:
                    await asyncio.wait(set(running))
            finally:
                reading = False
                wake.set()

        async def read_ops() -> None:
            async for batch in request_iterator:
                while len(ready) >= STREAM_WINDOW:
                    # The client is not reading its results: stop reading its ops too
                    # (gRPC flow control then holds the client back), or `ready` grows.
                    taken.clear()
                    await taken.wait()
                for op in batch.ops:
                    kind = op.WhichOneof("op")
                    if kind == "prompt":
                        prompt_arrived(op)
                    elif kind == "lookup" and op.lookup.prompt_follows:
                        # Not counted in the window: the reader must never wait for a slot
                        # that only a later prompt on this same stream could free.
                        if op.id in awaiting:
                            refuse(op.id, _INVALID, f"lookup {op.id} is already waiting for its prompt")
                            continue
                        if len(awaiting) >= STREAM_WINDOW:
                            refuse(op.id, _EXHAUSTED, f"{STREAM_WINDOW} lookups already wait for prompts")
                            continue
                        # Registered before the next op is read: its prompt may be in the same batch.
                        later = awaiting[op.id] = asyncio.get_running_loop().create_future()
                        start_task(run(op, later))
                    else:
                        await window.acquire()
                        start_task(run(op, None))

        reader = asyncio.create_task(read())
        try:
            while True:
                # Look before waiting: the last results and the end of the request
                # stream can arrive together, with no wake-up left to come.
                if ready:
                    out, ready[:] = list(ready), []
                    taken.set()
                    for results in by_size(out):
                        yield leases_pb2.LeaseOpResultBatch(results=results)
                    continue
                if not reading:
                    break
                await wake.wait()
                wake.clear()
            await reader  # surfaces a broken request stream
            if broken:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(broken[0]))
        finally:
            reader.cancel()
            for t in list(running):
                t.cancel()
            # Until each has taken its cancellation in (a claim then arranges its put-back,
            # which a daemon's stop waits for: see ControlPlane.settle).
            await asyncio.gather(reader, *running, return_exceptions=True)

    @_rpc("Leases/Get")
    async def Get(
        self, request: leases_pb2.GetLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.Lease:
        return lease_message(await self._cp.retentions.get(request.tenant, request.conversation_id))

    @_rpc("Leases/List")
    async def List(
        self, request: leases_pb2.ListLeasesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.ListLeasesResponse:
        views, token = await self._cp.retentions.list(
            request.tenant,
            request.all_tenants,
            request.engine_id,
            request.include_inactive,
            request.page_size,
            request.page_token,
        )
        return leases_pb2.ListLeasesResponse(leases=[lease_message(v) for v in views], next_page_token=token)

    @_rpc("Leases/Revoke")
    async def Revoke(
        self, request: leases_pb2.RevokeLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.RevokeLeaseResponse:
        view, releasable = await self._cp.retentions.revoke(request.tenant, request.conversation_id)
        if view is None:
            return leases_pb2.RevokeLeaseResponse(found=False)
        resp = leases_pb2.RevokeLeaseResponse(found=True, lease=lease_message(view))
        if releasable and view.retention is not None:
            apply_handout(view.retention.params, RELEASE, resp.release_params)
        return resp


async def _prompt_of(later: asyncio.Future[leases_pb2.LookupPrompt]) -> Prompt:
    return prompt_of(await later)


_INVALID, _EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED

# Operations one Leases/Stream may have in flight at once (backpressure beyond it).
STREAM_WINDOW = 1024
_STREAM_LATENCY = {
    False: metrics.RPC_LATENCY.labels("Leases/Stream.register"),
    True: metrics.RPC_LATENCY.labels("Leases/Stream.lookup"),
}

SERVICE_NAMES = (
    leases_pb2.DESCRIPTOR.services_by_name["Leases"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["Nodes"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


class _Undecodable:
    """A request message that did not parse (what `_DecodeGuard`'s deserializer returns)."""

    def __init__(self, error: Exception) -> None:
        self.message = f"the request message does not decode: {error}"


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # (protobuf's DecodeError: bad UTF-8, nesting too deep, ...)
            return _Undecodable(e)

    return deserialize


class _DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """A kvferry request that does not decode gets INVALID_ARGUMENT, not gRPC's UNKNOWN;
    on a stream, the handler sees InvalidArgument where the message would be (Leases/Stream
    still answers the ops it is running: a claim etcd applied keeps its answer)."""

    def __init__(self) -> None:
        self._guarded: dict[int, tuple[Any, Any]] = {}  # id(handler) -> (handler, guarded)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        # (continuation every time: an interceptor after this one runs on every call)
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/kvferry.v1."):
            return handler
        known = self._guarded.get(id(handler))
        if known is None or known[0] is not handler:
            known = self._guarded[id(handler)] = (handler, _guard(handler))
        return known[1]


def _guard(handler: Any) -> Any:
    """`handler` (a grpc.RpcMethodHandler) with the tolerant deserializer."""
    deserialize = _tolerant(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
    if handler.stream_stream is not None:
        streaming = handler.stream_stream

        async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Undecodable):
                    raise InvalidArgument(request.message)
                yield request

        async def stream_stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async for response in streaming(checked(requests), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)
    return handler  # (kvferry.v1 has no other kind)


async def start_server(
    cp: ControlPlane, listen: str, max_message_bytes: int, peers: Peers | None = None
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Build and start the gRPC server (Nodes/Score asks `peers` too). -> (server, bound
    port, health servicer)."""
    server = grpc.aio.server(
        interceptors=[_DecodeGuard()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Clients' keepalive pings are welcome (kvferry.channels), and the daemon pings
            # them: a sidecar or router gone without closing its connection ends its
            # streams (an Attach: the node's index and liveness) within seconds.
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    nodes_pb2_grpc.add_NodesServicer_to_server(
        NodesServicer(cp, Cluster(cp.registry, cp.attachments, peers)), server
    )
    leases_pb2_grpc.add_LeasesServicer_to_server(LeasesServicer(cp), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:  # grpc's way of saying the address is taken or bad
        raise OSError(f"cannot listen on {listen}: {e}") from e
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for name in ("", *SERVICE_NAMES[:2]):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health

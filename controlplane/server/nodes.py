"""The Nodes servicer: each RPC translates its message (controlplane.messages), calls one
domain operation, and builds the reply; errors become statuses in server/status.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from controlplane import metrics
from controlplane.blockindex import IndexUpdate
from controlplane.cluster import Cluster
from controlplane.errors import InvalidArgument, StoreUnavailable
from controlplane.messages import beat_of, node_message, registration_of, release_message
from controlplane.records import NodeRecord, NodeState
from controlplane.server.auth import allowed, caller, require
from controlplane.server.inbox import Inbox, Wake
from controlplane.server.status import refuse, rpc
from controlplane.service.attachments import Attachments
from controlplane.service.budgets import Release
from controlplane.service.nodes import ListedNode, NodeRegistry
from kvferry.security.roles import node_denial
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc

log = structlog.get_logger(__name__)


class NodesServicer(nodes_pb2_grpc.NodesServicer):
    """kvferry.v1.Nodes."""

    def __init__(self, registry: NodeRegistry, attachments: Attachments, cluster: Cluster) -> None:
        self._registry = registry
        self._attachments = attachments
        self._cluster = cluster

    @rpc("Nodes/Register")
    async def Register(
        self, request: nodes_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.RegisterNodeResponse:
        """Record a node (a new generation unless the same process registers again): only
        its own sidecar (or an admin) may."""
        require(node_denial(caller(), request.engine_id), "/kvferry.v1.Nodes/Register")
        rec, restarted = await self._registry.register(registration_of(request))
        return nodes_pb2.RegisterNodeResponse(
            node=node_message(ListedNode(NodeState(rec, True))), restarted=restarted
        )

    async def Attach(
        self,
        request_iterator: AsyncIterator[nodes_pb2.AttachRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[nodes_pb2.AttachResponse]:
        """A sidecar's stream: hello, then heartbeats (liveness) and KV events (the index)."""
        rec: NodeRecord | None = None
        stream = object()  # this stream, for the node's index to follow
        attachments = self._attachments
        inbox = Inbox(request_iterator)
        metrics.ATTACHED.inc()
        try:
            while (msg := await inbox.get()) is not None:
                if isinstance(msg, Wake):  # releases wait for the sidecar
                    for release in attachments.releases(rec, stream) if rec is not None else []:
                        yield release_message(release)
                    continue
                kind = msg.WhichOneof("body")
                if kind == "hello":
                    require(node_denial(caller(), msg.hello.engine_id), "/kvferry.v1.Nodes/Attach")
                    if rec is not None and msg.hello.engine_id != rec.engine_id:
                        raise InvalidArgument("an Attach stream speaks for one engine: open another")
                    hello = msg.hello
                    rec = await attachments.attach(hello.engine_id, hello.generation, stream, inbox.wake)
                    ttl, rec = await attachments.heartbeat(rec)
                    log.info("node.attached", engine_id=rec.engine_id, generation=rec.generation)
                    attached = node_message(ListedNode(NodeState(rec, True)))
                    yield nodes_pb2.AttachResponse(attached=attached, ttl_seconds=ttl)
                elif kind == "heartbeat":
                    if rec is None:
                        raise InvalidArgument("the first message on Attach must be hello")
                    ttl, rec, releases = await self._heartbeat(rec, msg.heartbeat, stream)
                    ack = nodes_pb2.Heartbeat(seq=msg.heartbeat.seq)
                    yield nodes_pb2.AttachResponse(heartbeat_ack=ack, ttl_seconds=ttl)
                    for release in releases:
                        yield release_message(release)
                elif kind == "kv_events":
                    if rec is None:
                        raise InvalidArgument("the first message on Attach must be hello")
                    b = msg.kv_events
                    update = IndexUpdate(list(b.stored), list(b.removed), b.cleared, b.reset, b.seq)
                    attachments.index_events(rec, update, stream)
                else:
                    raise InvalidArgument("Attach message has no body")
        except Exception as e:
            refuse(context, e, "Nodes/Attach")
        finally:
            # What must happen comes before the first await: the stream's end can reach
            # this handler twice (its requests end, then gRPC cancels it), and the second
            # lands in whatever this awaits; a node left attached would never be suspended.
            metrics.ATTACHED.dec()
            if rec is not None:
                attachments.detach(rec, stream)
                log.info("node.detached", engine_id=rec.engine_id)
            await inbox.close()

    async def _heartbeat(
        self, rec: NodeRecord, beat: nodes_pb2.Heartbeat, stream: object
    ) -> tuple[int, NodeRecord, list[Release]]:
        """-> (seconds of liveness left, 0 while etcd is out; the record to heartbeat next;
        the releases its sidecar is to make)."""
        releases = self._attachments.report(rec, beat_of(beat), stream)
        try:
            ttl, rec = await self._attachments.heartbeat(rec)
        except StoreUnavailable as e:
            # Keep the stream: the sidecar goes on heartbeating and liveness
            # resumes when etcd is back.
            log.warning("node.heartbeat.store_unavailable", engine_id=rec.engine_id, error=str(e))
            return 0, rec, releases
        return ttl, rec, releases

    @rpc("Nodes/List")
    async def List(
        self, request: nodes_pb2.ListNodesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.ListNodesResponse:
        """The nodes, with the largest counts any replica has of them."""
        listed = await self._cluster.list_nodes(
            int(request.role), request.include_dead, request.local_only, context.time_remaining()
        )
        return nodes_pb2.ListNodesResponse(nodes=[node_message(n) for n in listed])

    @rpc("Nodes/Score")
    async def Score(
        self, request: nodes_pb2.ScoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.ScoreResponse:
        """Alive nodes by how many leading blocks of a prompt they cache."""
        scores = await self._cluster.score(
            list(request.block_hashes), int(request.role), request.local_only, context.time_remaining()
        )
        return nodes_pb2.ScoreResponse(
            scores=[nodes_pb2.NodeScore(engine_id=e, cached_blocks=n) for e, n in scores]
        )

    @rpc("Nodes/Deregister")
    async def Deregister(
        self, request: nodes_pb2.DeregisterNodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.DeregisterNodeResponse:
        """End a node's liveness, leaving a tombstone of its record."""
        found = await self._registry.deregister(request.engine_id)
        allowed("/kvferry.v1.Nodes/Deregister", engine_id=request.engine_id, found=found)
        return nodes_pb2.DeregisterNodeResponse(found=found)

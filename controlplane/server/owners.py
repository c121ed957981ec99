"""The Owners servicer: an operation forwarded by another replica, run here when this
replica owns the conversation's shard (controlplane.owners), releases offered by
another replica, taken when the node's sidecar is attached here (service.relay), and the
promised notices of node demotions (controlplane.notices). Only the `daemon` role (and
admin) gets here: the auth interceptor refuses everyone else (kvferry.security.roles)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from controlplane.errors import FailedPrecondition, InvalidArgument
from controlplane.forward import answer_message, op_of, releases_of
from controlplane.owners import OwnedRetentions
from controlplane.server.status import rpc
from controlplane.service.budgets import Budgets
from controlplane.service.nodecache import NodeCache
from controlplane.store import EtcdStore
from kvferry.v1 import owners_pb2, owners_pb2_grpc


class OwnersServicer(owners_pb2_grpc.OwnersServicer):
    """kvferry.v1.Owners."""

    def __init__(self, owned: OwnedRetentions, budgets: Budgets, nodes: NodeCache, store: EtcdStore) -> None:
        self._owned = owned
        self._budgets = budgets
        self._nodes = nodes
        self._promises = store.promises
        self._writer = store.writer

    @rpc("Owners/Apply")
    async def Apply(
        self,
        request: owners_pb2.OwnerOp,
        context: grpc.aio.ServicerContext[owners_pb2.OwnerOp, owners_pb2.OwnerAnswer],
    ) -> owners_pb2.OwnerAnswer:
        """Run the operation at this replica (FAILED_PRECONDITION: not the shard's owner)."""
        return answer_message(await self._owned.apply_local(op_of(request)))

    @rpc("Owners/Release")
    async def Release(
        self,
        request: owners_pb2.NodeReleases,
        context: grpc.aio.ServicerContext[owners_pb2.NodeReleases, owners_pb2.NodeReleasesAnswer],
    ) -> owners_pb2.NodeReleasesAnswer:
        """Send the releases on the node's Attach stream, when it is held here."""
        taken = self._budgets.take_forwarded(request.engine_id, releases_of(request))
        return owners_pb2.NodeReleasesAnswer(taken=taken)

    @rpc("Owners/PromiseNotice")
    async def PromiseNotice(
        self,
        request: owners_pb2.NoticePromiseRequest,
        context: grpc.aio.ServicerContext[owners_pb2.NoticePromiseRequest, owners_pb2.NoticePromise],
    ) -> owners_pb2.NoticePromise:
        """Promise the asker notice of this replica's node demotions (FAILED_PRECONDITION:
        not now, ask again)."""
        if not request.replica or not request.address:
            raise InvalidArgument("PromiseNotice: replica and address are required")
        me = self._writer.me
        if not me or request.replica == me:
            raise FailedPrecondition("no promise: this replica is not announced in etcd, or is the asker")
        grant = self._promises.ask(request.replica, request.address)
        if grant is None:
            raise FailedPrecondition(
                "no promise now: a node demotion that did not tell the asker is under way, or one it "
                "did not answer waits out its promise"
            )
        return owners_pb2.NoticePromise(replica=me, seconds=self._promises.promise_s, grant=grant)

    @rpc("Owners/NodeDemoting")
    async def NodeDemoting(
        self,
        request: owners_pb2.NodeNotice,
        context: grpc.aio.ServicerContext[owners_pb2.NodeNotice, owners_pb2.NodeNoticeAnswer],
    ) -> owners_pb2.NodeNoticeAnswer:
        """Another replica is about to demote a node: its pulls are confirmed by reads here."""
        return self._noticed(request, self._nodes.doubts.demoting)

    @rpc("Owners/NodeDemoted")
    async def NodeDemoted(
        self,
        request: owners_pb2.NodeNotice,
        context: grpc.aio.ServicerContext[owners_pb2.NodeNotice, owners_pb2.NodeNoticeAnswer],
    ) -> owners_pb2.NodeNoticeAnswer:
        """That demotion is over: the node is confirmed once more by a read begun later."""
        return self._noticed(request, self._nodes.doubts.demoted)

    def _noticed(
        self, request: owners_pb2.NodeNotice, note: Callable[[str, str, int], None]
    ) -> owners_pb2.NodeNoticeAnswer:
        """A notice checked, `note`d (Doubts.demoting or .demoted), and answered as this replica."""
        if not request.replica or not request.engine_id:
            raise InvalidArgument("node notice: replica and engine_id are required")
        note(request.engine_id, request.replica, request.number)
        return owners_pb2.NodeNoticeAnswer(replica=self._writer.me)

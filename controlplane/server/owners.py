"""The Owners servicer: an operation forwarded by another replica, run here when this
replica owns the conversation's shard (controlplane.owners), and releases offered by
another replica, taken when the node's sidecar is attached here (service.relay). Only
the `daemon` role (and admin) gets here: the auth interceptor refuses everyone else
(kvferry.security.roles)."""

from __future__ import annotations

import grpc

from controlplane.forward import answer_message, op_of, releases_of
from controlplane.owners import OwnedRetentions
from controlplane.server.status import rpc
from controlplane.service.budgets import Budgets
from kvferry.v1 import owners_pb2, owners_pb2_grpc


class OwnersServicer(owners_pb2_grpc.OwnersServicer):
    """kvferry.v1.Owners."""

    def __init__(self, owned: OwnedRetentions, budgets: Budgets) -> None:
        self._owned = owned
        self._budgets = budgets

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

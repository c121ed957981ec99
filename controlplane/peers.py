"""The other daemon replicas, for a KV-event index that covers every sidecar.

A sidecar attaches to one replica, and that replica alone indexes its KV events. So
that `Nodes/Score` on any replica scores every prefill node, each replica announces
its address in etcd (a key under a lease of its own, gone within `ttl_s` of a crash)
and asks the others for their own index's scores (`local_only`), merging each node's
best count. A peer that does not answer within the deadline is left out: its nodes
score 0 from this answer, as they did before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc
import structlog

from controlplane.errors import StoreUnavailable
from controlplane.store import EtcdStore
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc

log = structlog.get_logger(__name__)


class Peers:
    """This replica's announcement, and stubs of the other replicas."""

    def __init__(
        self, store: EtcdStore, ttl_s: int = 10, refresh_s: float = 2.0, deadline_s: float = 0.02
    ) -> None:
        self.address = ""
        self._store = store
        self._ttl = ttl_s
        self._refresh = refresh_s
        self._deadline = deadline_s
        self._lease = 0
        self._peers: dict[str, tuple[grpc.aio.Channel, nodes_pb2_grpc.NodesAsyncStub]] = {}

    @property
    def addresses(self) -> list[str]:
        return sorted(self._peers)

    async def run(self, address: str) -> None:
        """Announce this replica at `address` and follow the others, until cancelled."""
        self.address = address
        while True:
            try:
                if not self._lease or not await self._store.refresh_replica(self._lease):
                    self._lease = await self._store.put_replica(self.address, self._ttl)
                    log.info("peers.announced", address=self.address)
                self._follow(await self._store.replicas())
            except StoreUnavailable as e:
                log.info("peers.refresh_failed", error=str(e))
            await asyncio.sleep(self._refresh)

    def _follow(self, announced: Sequence[str]) -> None:
        others = set(announced) - {self.address}
        for gone in set(self._peers) - others:
            channel, _ = self._peers.pop(gone)
            asyncio.get_running_loop().create_task(channel.close(None))
        for new in others - set(self._peers):
            channel = grpc.aio.insecure_channel(new)
            self._peers[new] = (channel, nodes_pb2_grpc.NodesStub(channel))

    async def scores(
        self, request: nodes_pb2.ScoreRequest, time_left_s: float | None
    ) -> list[nodes_pb2.ScoreResponse]:
        """The other replicas' own scores for `request` (those that answered in time:
        within the deadline, and well within the caller's `time_left_s`)."""
        if not self._peers:
            return []
        deadline = self._deadline if time_left_s is None else min(self._deadline, time_left_s / 2)
        local = nodes_pb2.ScoreRequest(block_hashes=request.block_hashes, role=request.role, local_only=True)
        calls = [stub.Score(local, timeout=deadline) for _, stub in self._peers.values()]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        return [a for a in answers if isinstance(a, nodes_pb2.ScoreResponse)]

    async def close(self) -> None:
        """Withdraw the announcement (peers stop asking at once) and close the channels."""
        if self._lease:
            with contextlib.suppress(StoreUnavailable):
                await self._store.revoke_lease_quietly(self._lease)
        for channel, _ in self._peers.values():
            await channel.close(None)
        self._peers.clear()

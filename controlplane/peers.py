"""The other daemon replicas, for a KV-event index that covers every sidecar.

A sidecar attaches to one replica, and that replica alone indexes its KV events. So
that `Nodes/Score` on any replica scores every prefill node, each replica announces
its address in etcd (a key of its own under an etcd lease of its own, gone within
`ttl_s` of a crash) and asks the others for their own index's scores (`local_only`);
`Nodes/List` likewise asks for the counts of the sidecars attached to them. This module
only asks (cluster.py merges the answers). A peer that does not answer within the
deadline is left out (its nodes score 0 from this answer, as they did before), and left
alone for `backoff_s`: a dead or unreachable one must not cost every scoring turn the
deadline.

With TLS the replicas call each other with the daemon's own certificate (the policy's
`daemon` role may call Nodes/Score and Nodes/List), at their advertised addresses, which
the certificate must name; a rotated certificate re-makes the channels.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import grpc
import structlog

from controlplane.errors import StoreUnavailable
from controlplane.store.replicas import ReplicaStore
from kvferry.channels import daemon_channel
from kvferry.security.tls import TlsFiles
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc

log = structlog.get_logger(__name__)
T = TypeVar("T")

_LEAST_DEADLINE_S = 0.001  # a call to the peers with less time than this is not made
_LATE_IN_A_ROW = 3  # shortened deadlines missed in a row that leave a peer out as a failed one
_STOP_TIMEOUT_S = 1.0  # the announcement's revoke at stop (it lapses by itself anyway)


class _Peer:
    def __init__(self, address: str, tls: TlsFiles | None) -> None:
        self.address = address
        self.channel = daemon_channel(address, tls)
        self.stub: nodes_pb2_grpc.NodesAsyncStub = nodes_pb2_grpc.NodesStub(self.channel)
        # Per kind of call ("Score", "List"): left out until, and answers in a row too
        # late for a shortened deadline (one kind's trouble does not leave out the other).
        self.skip_until: dict[str, float] = {}
        self.late: dict[str, int] = {}


class Peers:
    """This replica's announcement, and stubs of the other replicas."""

    def __init__(
        self,
        store: ReplicaStore,
        ttl_s: int = 10,
        refresh_s: float = 2.0,
        deadline_s: float = 0.02,
        backoff_s: float = 5.0,
        tls: TlsFiles | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex
        self._tls = tls
        self._rotation = None if tls is None else tls.watch()  # (a watcher of its own)
        self.address = ""
        self._store = store
        self._ttl = ttl_s
        self._refresh = refresh_s
        self._deadline = deadline_s
        self._backoff = backoff_s
        self._lease = 0
        self._peers: dict[str, _Peer] = {}  # by replica id
        self.on_rotated: list[Callable[[], None]] = []
        """Told when the TLS files rotated (other channels with this identity re-made)."""

    def live(self) -> int:
        """How many replicas are announced now, this one included."""
        return 1 + len(self._peers)

    @property
    def addresses(self) -> list[str]:
        """The other replicas followed now, by address."""
        return sorted(p.address for p in self._peers.values())

    async def run(self, address: str) -> None:
        """Announce this replica at `address` and follow the others, until cancelled."""
        self.address = address
        while True:
            try:
                if not self._lease or not await self._store.refresh(self._lease):
                    self._lease = 0
                    self._lease = await self._store.announce(self.id, address, self._ttl)
                    log.info("peers.announced", address=address, id=self.id)
                if self._rotation is not None and self._rotation.changed():
                    await self._drop_all()  # (rotated: followed again below, on new channels)
                    for rotated in self.on_rotated:
                        rotated()
                await self._follow(await self._store.announced())
            except StoreUnavailable as e:
                log.info("peers.refresh_failed", error=str(e))
            except Exception:  # (a lease gone under us, an odd key): try again, never stop
                log.exception("peers.refresh_crashed")
            await asyncio.sleep(self._refresh)

    async def _follow(self, announced: Mapping[str, str]) -> None:
        others = {i: a for i, a in announced.items() if i != self.id and a}  # ("": not reachable)
        for i in [i for i, p in self._peers.items() if others.get(i) != p.address]:
            await self._peers.pop(i).channel.close(None)
        for i, address in others.items():
            if i not in self._peers:
                self._peers[i] = _Peer(address, self._tls)
                log.info("peers.following", address=address, id=i)

    async def scores(
        self, hashes: list[int], role: int, time_left_s: float | None
    ) -> list[nodes_pb2.ScoreResponse]:
        """The other replicas' own scores of a prompt's block `hashes` for nodes of `role`
        (those that answered in time: within the deadline, and well within the caller's
        `time_left_s`)."""
        local = nodes_pb2.ScoreRequest(block_hashes=hashes, role=role, local_only=True)  # type: ignore[arg-type]
        return await self._ask(
            "Score", lambda stub, deadline: stub.Score(local, timeout=deadline), time_left_s
        )

    async def node_lists(self, time_left_s: float | None) -> list[nodes_pb2.ListNodesResponse]:
        """The other replicas' own lists of every node, with the counts their sidecars
        reported there (those that answered in time)."""
        local = nodes_pb2.ListNodesRequest(include_dead=True, local_only=True)
        return await self._ask("List", lambda stub, deadline: stub.List(local, timeout=deadline), time_left_s)

    async def _ask(
        self,
        kind: str,
        call: Callable[[nodes_pb2_grpc.NodesAsyncStub, float], Awaitable[T]],
        time_left_s: float | None,
    ) -> list[T]:
        """`call(stub, deadline)` on each peer not left out for `kind` -> the answers that
        came in time."""
        now = time.monotonic()
        asked = [p for p in self._peers.values() if p.skip_until.get(kind, 0.0) <= now]
        if not asked:
            return []
        deadline = self._deadline if time_left_s is None else min(self._deadline, time_left_s / 2)
        if deadline < _LEAST_DEADLINE_S:  # no time to ask anyone
            return []
        answers = await asyncio.gather(*(call(p.stub, deadline) for p in asked), return_exceptions=True)
        out: list[T] = []
        for peer, answer in zip(asked, answers, strict=True):
            if not isinstance(answer, BaseException):
                out.append(answer)
                peer.late[kind] = 0
            elif isinstance(answer, grpc.aio.AioRpcError):
                code = answer.code()
                # Late within a deadline the caller's own shortened is this call's loss, not
                # the peer's failure: only one that failed otherwise, missed the whole
                # deadline, or was late every time lately (a hung one) is left out a while.
                shortened = code is grpc.StatusCode.DEADLINE_EXCEEDED and deadline < self._deadline
                late = peer.late.get(kind, 0) + 1 if shortened else 0
                if not shortened or late >= _LATE_IN_A_ROW:
                    peer.skip_until[kind], late = time.monotonic() + self._backoff, 0
                peer.late[kind] = late
                log.info("peers.ask_failed", address=peer.address, call=kind, code=code.name)
        return out

    async def close(self) -> None:
        """Withdraw the announcement (the others stop asking at their next refresh) and
        close the channels."""
        if self._lease:
            try:
                async with asyncio.timeout(_STOP_TIMEOUT_S):
                    await self._store.withdraw(self._lease)
            except TimeoutError:
                log.info("peers.revoke_timed_out", lease=self._lease)
        await self._drop_all()

    async def _drop_all(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close(None)
        self._peers.clear()

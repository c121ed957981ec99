"""Forwarding an operation to its shard's owner replica, and a decode node's releases to
the replica its sidecar is attached to: the client side of the daemon-only Owners RPC
(kvferry.v1.Owners), and the one mapping between its messages and controlplane.owners.ops
and service.budgets.Release (the server side, server/owners.py, uses the same).

The replicas call each other with the daemon's own certificate (the policy's `daemon`
role may call the Owners RPC), at the addresses they advertise in their owner keys (Apply)
and announcements (Release, to every peer: controlplane.peers; the promised notices of
node demotions, controlplane.notices).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
import msgspec
import structlog

from controlplane.budget import Reason
from controlplane.errors import InvalidArgument, NotApplied, StoreUnavailable
from controlplane.owners.ops import Kind, OwnerAnswer, OwnerOp
from controlplane.owners.routed import NotOwner
from controlplane.records import Claim, Retention, decode_claim, decode_retention, encode
from controlplane.service.budgets import Release
from kvferry.channels import daemon_channel
from kvferry.security.tls import TlsFiles
from kvferry.tasks import cancel_and_wait
from kvferry.v1 import owners_pb2, owners_pb2_grpc

log = structlog.get_logger(__name__)

RELEASE_TIMEOUT_S = 2.0
"""How long an offer of releases waits for each replica's answer."""


def op_message(op: OwnerOp) -> owners_pb2.OwnerOp:
    """An operation as the Owners RPC carries it."""
    return owners_pb2.OwnerOp(
        kind=int(op.kind),  # type: ignore[arg-type]
        tenant=op.tenant,
        conversation_id=op.conversation_id,
        now=op.now,
        retention=encode(op.retention) if op.retention is not None else b"",
        claim=encode(op.claim) if op.claim is not None else b"",
        number=op.number,
        claimed_by=op.claimed_by,
    )


def op_of(m: owners_pb2.OwnerOp) -> OwnerOp:
    """A forwarded operation (InvalidArgument: one that does not decode)."""
    try:
        kind = Kind(m.kind)
        retention = decode_retention(m.retention) if m.retention else None
        claim = decode_claim(m.claim) if m.claim else None
    except (ValueError, msgspec.DecodeError) as e:
        raise InvalidArgument(f"owner op: {e}") from e
    if kind in (Kind.PUT, Kind.UNCLAIM) and retention is None:
        raise InvalidArgument(f"owner op {kind.name}: retention is required")
    if kind is Kind.NOTE_DEADLINE and claim is None:
        raise InvalidArgument("owner op NOTE_DEADLINE: claim is required")
    return OwnerOp(kind, m.tenant, m.conversation_id, m.now, retention, claim, m.number, m.claimed_by)


def answer_message(a: OwnerAnswer) -> owners_pb2.OwnerAnswer:
    """An owner's answer as the Owners RPC carries it."""
    return owners_pb2.OwnerAnswer(
        retention=encode(a.retention) if a.retention is not None else b"",
        claim=encode(a.claim) if a.claim is not None else b"",
        number=a.number,
        done=a.done,
    )


def answer_of(m: owners_pb2.OwnerAnswer) -> OwnerAnswer:
    """An owner's answer, decoded."""
    retention: Retention | None = decode_retention(m.retention) if m.retention else None
    claim: Claim | None = decode_claim(m.claim) if m.claim else None
    return OwnerAnswer(retention, claim, m.number, m.done)


def releases_message(engine_id: str, releases: Iterable[Release]) -> owners_pb2.NodeReleases:
    """A node's releases as the Owners RPC carries them."""
    return owners_pb2.NodeReleases(
        engine_id=engine_id,
        releases=[
            owners_pb2.ForwardedRelease(
                tenant=r.tenant,
                conversation_id=r.conversation_id,
                params=r.params,
                reason=r.reason.value,
                expires_at=r.expires_at,
            )
            for r in releases
        ],
    )


def releases_of(m: owners_pb2.NodeReleases) -> list[Release]:
    """Forwarded releases (InvalidArgument: a reason this replica does not know)."""
    out = []
    for r in m.releases:
        try:
            reason = Reason(r.reason)
        except ValueError as e:
            raise InvalidArgument(f"release of {r.conversation_id!r}: unknown reason {r.reason!r}") from e
        out.append(Release(r.tenant, r.conversation_id, r.params, reason, r.expires_at))
    return out


class OwnerClient:
    """Channels to the owner replicas, by address (owners.Forwarder)."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self._tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, owners_pb2_grpc.OwnersAsyncStub]] = {}

    async def apply(self, address: str, op: OwnerOp, timeout_s: float) -> OwnerAnswer:
        """Run `op` at the replica at `address` (NotOwner: it does not own the shard;
        NotApplied: it turned the op away undecided; StoreUnavailable: it did not answer)."""
        stub = self._stub(address)
        try:
            answer = await stub.Apply(op_message(op), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise NotOwner(e.details() or "not the owner") from e
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(e.details() or "") from e
            if e.code() == grpc.StatusCode.ABORTED:  # (turned away there undecided)
                raise NotApplied(f"owner replica {address}: {e.details()}") from e
            raise StoreUnavailable(f"owner replica {address}: {e.code().name}: {e.details()}") from e
        return answer_of(answer)

    async def offer_releases(self, addresses: Iterable[str], engine_id: str, releases: list[Release]) -> bool:
        """Offer a node's releases to the replicas at `addresses` at once. -> whether one
        took them (the node is attached there), as soon as one did (a hung replica costs
        nothing then); False when none did, or answered in time."""
        message = releases_message(engine_id, releases)

        async def offer(address: str) -> bool:
            try:
                answer = await self._stub(address).Release(message, timeout=RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.info("release.offer_failed", address=address, code=e.code().name, details=e.details())
                return False
            return answer.taken

        offers = [asyncio.ensure_future(offer(a)) for a in addresses]
        try:
            for answered in asyncio.as_completed(offers):
                if await answered:
                    return True
            return False
        finally:
            await cancel_and_wait(offers)  # (the others' answers no longer matter)

    async def promise(
        self, address: str, me: str, my_address: str, timeout_s: float
    ) -> owners_pb2.NoticePromise:
        """Ask the replica at `address` for its promise of notice (controlplane.notices)."""
        request = owners_pb2.NoticePromiseRequest(replica=me, address=my_address)
        return await self._stub(address).PromiseNotice(request, timeout=timeout_s)

    async def demoting(self, address: str, me: str, engine_id: str, number: int, timeout_s: float) -> str:
        """Tell the replica at `address` of demotion `number` of `engine_id` about to be
        written (notices.NoticeTransport). -> the id of the replica that answered."""
        notice = owners_pb2.NodeNotice(replica=me, engine_id=engine_id, number=number)
        return (await self._stub(address).NodeDemoting(notice, timeout=timeout_s)).replica

    async def demoted(self, address: str, me: str, engine_id: str, number: int, timeout_s: float) -> str:
        """Tell it that demotion is over. -> the id of the replica that answered."""
        notice = owners_pb2.NodeNotice(replica=me, engine_id=engine_id, number=number)
        return (await self._stub(address).NodeDemoted(notice, timeout=timeout_s)).replica

    def _stub(self, address: str) -> owners_pb2_grpc.OwnersAsyncStub:
        held = self._stubs.get(address)
        if held is None:
            channel = daemon_channel(address, self._tls)
            held = (channel, owners_pb2_grpc.OwnersStub(channel))
            self._stubs[address] = held
        return held[1]

    def rotated(self) -> None:
        """The TLS files changed: new channels from now on (the old ones end with their calls)."""
        self._stubs.clear()

    async def close(self) -> None:
        """Close every channel."""
        for channel, _ in self._stubs.values():
            await channel.close(None)
        self._stubs.clear()

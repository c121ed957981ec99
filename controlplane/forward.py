"""Forwarding an operation to its shard's owner replica: the client side of the daemon-only
Owners RPC (kvferry.v1.Owners), and the one mapping between its messages and
controlplane.owners.ops (the server side, server/owners.py, uses the same).

The replicas call each other with the daemon's own certificate (the policy's `daemon`
role may call Owners/Apply), at the addresses they advertise in their owner keys.
"""

from __future__ import annotations

import grpc
import msgspec

from controlplane.errors import InvalidArgument, StoreUnavailable
from controlplane.owners.ops import Kind, OwnerAnswer, OwnerOp
from controlplane.owners.routed import NotOwner
from controlplane.records import Claim, Retention, decode_claim, decode_retention, encode
from kvferry.channels import daemon_channel
from kvferry.security.tls import TlsFiles
from kvferry.v1 import owners_pb2, owners_pb2_grpc


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


class OwnerClient:
    """Channels to the owner replicas, by address (owners.Forwarder)."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self._tls = tls
        self._stubs: dict[str, tuple[grpc.aio.Channel, owners_pb2_grpc.OwnersAsyncStub]] = {}

    async def apply(self, address: str, op: OwnerOp, timeout_s: float) -> OwnerAnswer:
        """Run `op` at the replica at `address` (NotOwner: it does not own the shard;
        StoreUnavailable: it did not answer)."""
        stub = self._stub(address)
        try:
            answer = await stub.Apply(op_message(op), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise NotOwner(e.details() or "not the owner") from e
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(e.details() or "") from e
            raise StoreUnavailable(f"owner replica {address}: {e.code().name}: {e.details()}") from e
        return answer_of(answer)

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

"""An operation on a conversation's retention as its shard's owner runs it, whether it
came from this replica or was forwarded by another (the Owners RPC carries exactly
these fields), and the one function that decides it in memory."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controlplane.owners.memory import Conversation, ShardMemory, Write
from controlplane.records import Claim, Retention
from controlplane.store.retentions import Stored


class Kind(enum.IntEnum):
    """Mirrors kvferry.v1.OwnerOp.Kind."""

    CLAIM = 1
    PUT = 2
    UNCLAIM = 3
    NOTE_DEADLINE = 4
    REVOKE = 5
    REVOKE_EXACT = 6
    READ = 7


@dataclass(frozen=True)
class OwnerOp:
    """One operation for a shard's owner."""

    kind: Kind
    tenant: str
    conversation_id: str
    now: float = 0.0
    retention: Retention | None = None
    """PUT: the new one; UNCLAIM: the one to put back."""
    claim: Claim | None = None
    """NOTE_DEADLINE: the marker to write."""
    number: int = 0
    """UNCLAIM, NOTE_DEADLINE: the marker's identity; REVOKE_EXACT: the revision."""
    claimed_by: str = ""


@dataclass(frozen=True)
class OwnerAnswer:
    """What the owner answered."""

    retention: Retention | None = None
    """CLAIM: taken; PUT: replaced; REVOKE, REVOKE_EXACT, READ: the retention."""
    claim: Claim | None = None
    """CLAIM: the earlier claim's marker; READ: the marker."""
    number: int = 0
    """CLAIM: the marker's identity; PUT, REVOKE, READ: the retention's revision."""
    done: bool = False
    """UNCLAIM: put back; NOTE_DEADLINE: written."""


WAITS = frozenset(Kind) - {Kind.CLAIM, Kind.READ}
"""What answers only once its writes are in etcd (a claim answers at once)."""


def decide(memory: ShardMemory, op: OwnerOp, marker: int) -> tuple[OwnerAnswer, list[Write]]:
    """Run `op` on the shard's memory (`marker`: the identity a claim's marker gets).
    -> (the answer, the writes that make it durable)."""
    c = Conversation(op.tenant, op.conversation_id)
    if op.kind is Kind.CLAIM:
        outcome, writes = memory.claim(c, op.now, op.claimed_by, marker)
        return OwnerAnswer(outcome.taken, outcome.earlier, outcome.marker_revision), writes
    if op.kind is Kind.PUT:
        assert op.retention is not None
        replaced, writes = memory.put(c, op.retention)
        return OwnerAnswer(replaced), writes
    if op.kind is Kind.UNCLAIM:
        assert op.retention is not None
        back = memory.unclaim(c, op.retention, op.number, op.now)
        return OwnerAnswer(done=back is not None), back or []
    if op.kind is Kind.NOTE_DEADLINE:
        assert op.claim is not None
        noted = memory.note_deadline(c, op.number, op.claim)
        return OwnerAnswer(done=noted is not None), noted or []
    if op.kind is Kind.REVOKE:
        held, writes = memory.revoke(c)
        return OwnerAnswer(held.retention if held else None, number=held.revision if held else 0), writes
    if op.kind is Kind.REVOKE_EXACT:
        taken, writes = memory.revoke_exact(c, op.number)
        return OwnerAnswer(taken), writes
    stored, claim = memory.read(c, op.now)
    return OwnerAnswer(stored.retention if stored else None, claim, stored.revision if stored else 0), []


def stored_of(op: OwnerOp, answer: OwnerAnswer) -> Stored | None:
    """A REVOKE's or READ's retention, as the store reports one."""
    if answer.retention is None:
        return None
    return Stored(op.tenant, op.conversation_id, answer.retention, answer.number)

"""One shard's retentions and claim markers in its owner's memory, and every decision
on them: pure, synchronous code (no await between a check and what it takes), each
decision returning the etcd writes that make it durable, in order.

For an owned shard, this memory is the truth and etcd its durable copy: a claim is
decided here and answered at once; its writes go behind it (writeback.py), in the
order the decisions were made, so that etcd ends where memory is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from controlplane.records import Claim, Retention
from controlplane.store.retentions import ClaimOutcome, Stored


class Conversation(msgspec.Struct, frozen=True, gc=False):
    """(tenant, conversation id): the key of an owner's maps, and of the budget's.

    Not a tuple: a fresh tuple is tracked by the cyclic garbage collector, and putting one
    into a map the collector had untracked tracks the map again, in the youngest
    generation. The next collections then walked the whole map, 100,000s of entries, and
    stalled every lookup for 20-100 ms. With this key and untracked values (Held, Marked)
    a map stays untracked."""

    tenant: str
    conversation_id: str


class Target(enum.Enum):
    """What a write is to: a conversation's retention or its claim marker."""

    RETENTION = "retention"
    MARKER = "marker"


@dataclass(frozen=True)
class Write:
    """One durable write a decision needs: a put (`value`) or a delete (None)."""

    target: Target
    conversation: Conversation
    value: Retention | Claim | None
    deadline: float = 0.0
    """When etcd may collect a put (its GC lease's bucket)."""


class Held(msgspec.Struct, gc=False):
    """A retention in memory. (Untracked by the cyclic garbage collector, as Marked: an
    owner holds one per live conversation, and a full collection walking 100,000s of them
    stalled every lookup for 100s of milliseconds. Their fields are never containers.)"""

    retention: Retention
    revision: int = 0
    """Its etcd revision once written (0: its write is still behind)."""


class Marked(msgspec.Struct, gc=False):
    """A claim marker in memory (untracked by the garbage collector, as Held)."""

    claim: Claim
    marker: int
    """Its identity: what a put-back or a deadline note names (`ClaimOutcome.marker_revision`)."""


@dataclass
class ShardMemory:
    """The retentions and markers of one shard, as its owner decides on them."""

    marker_s: float
    """How long a marker is kept (GcSettings.claim_marker_s)."""
    retentions: dict[Conversation, Held] = field(default_factory=dict)
    markers: dict[Conversation, Marked] = field(default_factory=dict)
    stored: set[Conversation] = field(default_factory=set)
    """Conversations etcd holds records of that memory has not read yet (`learn`: read on
    first touch). Any other conversation has none in etcd but what memory wrote."""

    def needs(self, c: Conversation) -> bool:
        """Whether the conversation must be read from etcd before any decision on it."""
        return c in self.stored

    def learn(self, c: Conversation, held: Held | None, claim: Claim | None) -> None:
        """The conversation as etcd holds it (read after this owner took the shard, before
        any decision on it here)."""
        if not self.needs(c):
            return
        self.stored.discard(c)
        if held is not None:
            self.retentions[c] = held
        if claim is not None:
            self.markers[c] = Marked(claim, 0)

    def claimable(self, c: Conversation, now: float) -> tuple[Retention | None, Claim | None]:
        """What `claim` would take (the retention) or find (an earlier claim's marker),
        taking nothing."""
        held = self.retentions.get(c)
        if held is not None:
            return held.retention, None
        earlier = self.marker(c, now)
        return None, earlier.claim if earlier else None

    def claim(
        self, c: Conversation, now: float, claimed_by: str, marker: int
    ) -> tuple[ClaimOutcome, list[Write]]:
        """Take the conversation's retention, leaving marker number `marker`; or say which
        earlier claim took it."""
        retention, earlier = self.claimable(c, now)
        if retention is None:
            return ClaimOutcome(None, earlier=earlier), []
        del self.retentions[c]
        claim = Claim(claimed_at=now, claimed_by=claimed_by)
        self.markers[c] = Marked(claim, marker)
        writes = [
            Write(Target.RETENTION, c, None),
            Write(Target.MARKER, c, claim, now + self.marker_s),
        ]
        return ClaimOutcome(retention, marker_revision=marker), writes

    def put(self, c: Conversation, r: Retention) -> tuple[Retention | None, list[Write]]:
        """Store a retention in place of the conversation's previous one. -> (the one it
        replaced: never claimed, as a claim takes it out; the writes)."""
        replaced = self.retentions.get(c)
        self.retentions[c] = Held(r)
        return (replaced.retention if replaced else None), [Write(Target.RETENTION, c, r, r.expires_at)]

    def unclaim(self, c: Conversation, r: Retention, marker: int, now: float) -> list[Write] | None:
        """Put back what the claim of `marker` took, unless past its deadline, replaced,
        revoked or claimed again since. -> the writes (None: not put back)."""
        held = self.markers.get(c)
        if r.expires_at <= now or c in self.retentions or held is None or held.marker != marker:
            return None
        del self.markers[c]
        self.retentions[c] = Held(r)
        return [Write(Target.RETENTION, c, r, r.expires_at), Write(Target.MARKER, c, None)]

    def note_deadline(self, c: Conversation, marker: int, claim: Claim) -> list[Write] | None:
        """Write `claim` over the marker `marker`, if it is still that one. -> the writes
        (None: it is not)."""
        held = self.markers.get(c)
        if held is None or held.marker != marker:
            return None
        held.claim = claim
        return [Write(Target.MARKER, c, claim, claim.claimed_at + self.marker_s)]

    def revoke(self, c: Conversation) -> tuple[Held | None, list[Write]]:
        """Delete the retention and its marker. -> (the retention deleted, the writes)."""
        held = self.retentions.pop(c, None)
        marked = self.markers.pop(c, None)
        if held is None and marked is None:
            return None, []
        return held, [Write(Target.RETENTION, c, None), Write(Target.MARKER, c, None)]

    def revoke_exact(self, c: Conversation, revision: int) -> tuple[Retention | None, list[Write]]:
        """Delete the retention only if it is still the one written at `revision`, and the
        marker with it, as `revoke` does: an older claim's late put-back must not bring
        back what this retention replaced (the history checker found it in the etcd
        claims: main's a5bde6a)."""
        held = self.retentions.get(c)
        if held is None or not revision or held.revision != revision:
            return None, []
        del self.retentions[c]
        self.markers.pop(c, None)
        return held.retention, [Write(Target.RETENTION, c, None), Write(Target.MARKER, c, None)]

    def read(self, c: Conversation, now: float) -> tuple[Stored | None, Claim | None]:
        """The retention and the live marker, as they are."""
        held = self.retentions.get(c)
        stored = Stored(c.tenant, c.conversation_id, held.retention, held.revision) if held else None
        marked = self.marker(c, now)
        return stored, marked.claim if marked else None

    def marker(self, c: Conversation, now: float) -> Marked | None:
        """The conversation's marker while it is kept."""
        held = self.markers.get(c)
        if held is not None and held.claim.claimed_at + self.marker_s <= now:
            del self.markers[c]
            return None
        return held

    def written(self, writes: list[Write], revision: int) -> None:
        """The writes are in etcd at `revision`: the retentions they put carry it (when
        memory still holds those same ones)."""
        for w in writes:
            if w.target is Target.RETENTION and w.value is not None:
                held = self.retentions.get(w.conversation)
                if held is not None and held.retention is w.value:
                    held.revision = revision

    def sweep(self, now: float, slack_s: float) -> None:
        """Forget retentions `slack_s` past their deadline and markers past their keep (etcd
        collects their keys by itself, on their GC leases)."""
        gone = [c for c, h in self.retentions.items() if h.retention.expires_at + slack_s <= now]
        for c in gone:
            del self.retentions[c]
        forgotten = [c for c, m in self.markers.items() if m.claim.claimed_at + self.marker_s <= now]
        for c in forgotten:
            del self.markers[c]

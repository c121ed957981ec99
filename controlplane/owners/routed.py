"""Every operation on a retention or claim marker, taken to its shard's owner: run here
in memory when this replica owns the shard (taking it first when nobody does), else
forwarded to the owner replica (`Forwarder`: the Owners RPC, kvferry.v1.Owners).

`OwnedRetentions` has the methods (and the answers) of store.RetentionStore that the
service layer uses, so claims, lookups, registrations, revokes and budget releases run
unchanged on top of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from controlplane import metrics
from controlplane.errors import FailedPrecondition, NotApplied, StoreUnavailable, not_applied
from controlplane.owners.durable import OwnerStore
from controlplane.owners.memory import Conversation, Held
from controlplane.owners.ops import WAITS, Kind, OwnerAnswer, OwnerOp, decide, stored_of
from controlplane.owners.owner import OwnedShard, ShardOwners
from controlplane.records import Claim, OwnerRecord, Retention
from controlplane.store.retentions import ClaimOutcome, Stored
from kvferry.shards import shard_of

log = structlog.get_logger(__name__)

OWNER_CACHE_S = 2.0
"""How long a remote owner read from etcd is used before it is read again."""
ROUTES_S = 1.0
"""How long one read of every shard's owner answers Leases/Routes (routers ask each second)."""


class NotOwner(FailedPrecondition):
    """A forwarded operation reached a replica that does not own (or no longer owns) the
    shard: the caller reads the owner again."""


class Forwarder(Protocol):
    """Sends an operation to the replica at `address` (the Owners RPC). Raises NotOwner
    when that replica does not own the shard, NotApplied when it turned the operation away
    undecided, StoreUnavailable when it does not answer."""

    async def apply(self, address: str, op: OwnerOp, timeout_s: float) -> OwnerAnswer: ...


class OwnedRetentions:
    """Retentions and markers, decided by their shards' owners."""

    def __init__(
        self,
        owners: ShardOwners,
        store: OwnerStore,
        forwarder: Forwarder | None,
        timeout_s: float,
    ) -> None:
        self.owners = owners
        self._store = store
        self.forwarder = forwarder
        self._timeout = timeout_s
        self._remote: dict[int, tuple[OwnerRecord, float]] = {}
        self._fetching: dict[
            tuple[int, int, Conversation], asyncio.Future[tuple[Held | None, Claim | None]]
        ] = {}
        self._routes: asyncio.Future[dict[int, OwnerRecord]] | None = None
        self._routes_until = 0.0

    async def claim(
        self, tenant: str, conversation_id: str, now: float, claimed_by: str = ""
    ) -> ClaimOutcome:
        """As RetentionStore.claim: decided by the owner, answered before it is durable."""
        a = await self.apply(OwnerOp(Kind.CLAIM, tenant, conversation_id, now, claimed_by=claimed_by))
        return _claim_outcome(a)

    def claim_now(
        self,
        tenant: str,
        conversation_id: str,
        now: float,
        claimed_by: str = "",
        accept: Callable[[Retention | None, Claim | None], bool] | None = None,
    ) -> ClaimOutcome | None:
        """`claim` decided without awaiting anything, when this replica owns the shard and
        has the conversation in memory (the usual case); None when it cannot be (nothing
        was claimed: then `claim`). No task, no await: nothing can cut it short.

        `accept` is shown what the claim would take (the retention) or find (an earlier
        claim's marker) first: False, and nothing is claimed (None)."""
        owned = self.owners.local_now(shard_of(tenant, conversation_id, self.owners.settings.shards))
        c = Conversation(tenant, conversation_id)
        if owned is None or owned.memory.needs(c):
            return None
        if accept is not None and not accept(*owned.memory.claimable(c, now)):
            return None
        op = OwnerOp(Kind.CLAIM, tenant, conversation_id, now, claimed_by=claimed_by)
        return _claim_outcome(self._decided(owned, op)[0])

    async def put(
        self, tenant: str, conversation_id: str, r: Retention, now: float
    ) -> tuple[int, Retention | None]:
        """As RetentionStore.put -> (revision, the retention it replaced, never claimed)."""
        a = await self.apply(OwnerOp(Kind.PUT, tenant, conversation_id, now, retention=r))
        return a.number, a.retention

    async def unclaim(
        self, tenant: str, conversation_id: str, r: Retention, marker_revision: int, now: float
    ) -> bool:
        """As RetentionStore.unclaim."""
        op = OwnerOp(Kind.UNCLAIM, tenant, conversation_id, now, retention=r, number=marker_revision)
        return (await self.apply(op)).done

    async def note_claim_deadline(
        self, tenant: str, conversation_id: str, marker_revision: int, claim: Claim
    ) -> bool:
        """As RetentionStore.note_claim_deadline."""
        op = OwnerOp(Kind.NOTE_DEADLINE, tenant, conversation_id, claim=claim, number=marker_revision)
        return (await self.apply(op)).done

    async def read(self, tenant: str, conversation_id: str) -> tuple[Stored | None, Claim | None]:
        """As RetentionStore.read, from the owner's memory."""
        op = OwnerOp(Kind.READ, tenant, conversation_id, time.time())
        a = await self.apply(op)
        return stored_of(op, a), a.claim

    async def revoke_exact(self, tenant: str, conversation_id: str, revision: int) -> Retention | None:
        """As RetentionStore.revoke_exact."""
        return (
            await self.apply(OwnerOp(Kind.REVOKE_EXACT, tenant, conversation_id, number=revision))
        ).retention

    async def revoke(self, tenant: str, conversation_id: str) -> Stored | None:
        """As RetentionStore.revoke."""
        op = OwnerOp(Kind.REVOKE, tenant, conversation_id)
        return stored_of(op, await self.apply(op))

    async def apply(self, op: OwnerOp) -> OwnerAnswer:
        """Run `op` at its shard's owner (taking the shard when nobody owns it).

        NotApplied when it was turned away before any owner decided it (the shard's
        ownership not confirmed in time, etcd not answering a read, no owner in time):
        sending it again is safe. StoreUnavailable when it was decided, or forwarded, and
        what became of it is not known."""
        shard = shard_of(op.tenant, op.conversation_id, self.owners.settings.shards)
        deadline = time.monotonic() + self.owners.settings.wait_s
        while True:
            try:  # (nothing is decided before `_run`, here or at a replica forwarded to)
                owned = await self.owners.local(shard)
                if owned is None and (owner := await self._owner(shard)) is None:
                    owned = await self.owners.take(shard)
                if owned is not None and not await self._learned(owned, op):
                    continue  # (etcd answered: the shard may have moved meanwhile)
            except StoreUnavailable as e:
                raise not_applied(e) from e
            if owned is not None:
                return await self._run(owned, op)
            if owner is not None and owner.replica != self.owners.me.replica:
                if self.forwarder is None or not owner.address:
                    raise NotApplied(
                        f"shard {shard} is owned by replica {owner.replica}, which has no address"
                    )
                try:
                    metrics.FORWARDED.labels(op.kind.name.lower()).inc()
                    return await self.forwarder.apply(owner.address, op, self._timeout)
                except NotOwner:
                    self._remote.pop(shard, None)
                except StoreUnavailable:
                    self._remote.pop(shard, None)  # (read again next time: it may be gone)
                    raise
            if time.monotonic() > deadline:
                raise NotApplied(f"shard {shard}: no owner could take the operation in time")
            self._remote.pop(shard, None)
            await asyncio.sleep(0.02)

    async def routes(self) -> dict[int, OwnerRecord]:
        """Every shard's owner, as etcd had it at most ROUTES_S ago: one read shared by the
        routers asking meanwhile (StoreUnavailable: etcd did not answer it)."""
        now = time.monotonic()
        if self._routes is None or now >= self._routes_until:
            self._routes = asyncio.ensure_future(self._store.owners())
            self._routes_until = now + ROUTES_S
        reading = self._routes
        try:
            return await asyncio.shield(reading)
        except StoreUnavailable:
            if self._routes is reading:
                self._routes_until = 0.0  # (the next caller reads again)
            raise

    async def apply_local(self, op: OwnerOp) -> OwnerAnswer:
        """Run an operation forwarded by another replica: only when this one owns the shard."""
        shard = shard_of(op.tenant, op.conversation_id, self.owners.settings.shards)
        for _ in range(2):
            try:
                owned = await self.owners.local(shard)
                learned = owned is not None and await self._learned(owned, op)
            except StoreUnavailable as e:
                raise not_applied(e) from e
            if owned is None:
                break
            if learned:
                return await self._run(owned, op)
        raise NotOwner(f"replica {self.owners.me.replica} does not own shard {shard}")

    async def _learned(self, owned: OwnedShard, op: OwnerOp) -> bool:
        """Whether the operation's conversation is in memory: read from etcd first when the
        shard is loaded lazily (once per conversation: concurrent first touches share the
        read). -> False when it had to be read (the caller checks ownership again)."""
        c = Conversation(op.tenant, op.conversation_id)
        if not owned.memory.needs(c):
            return True
        key = (owned.shard, owned.fence, c)
        reading = self._fetching.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._store.fetch(c))
            self._fetching[key] = reading
            reading.add_done_callback(lambda _: self._fetching.pop(key, None))
        held, claim = await asyncio.shield(reading)
        owned.memory.learn(c, held, claim)
        return False

    def _decided(self, owned: OwnedShard, op: OwnerOp) -> tuple[OwnerAnswer, asyncio.Future[int] | None]:
        """Decide `op` in the owned shard's memory and queue its writes. -> the answer, and
        the future of its writes' revision when the kind of op waits for them (WAITS)."""
        marker = self.owners.marker() if op.kind is Kind.CLAIM else 0
        answer, writes = decide(owned.memory, op, marker)
        return answer, self.owners.writes.add(
            owned.shard, owned.fence, owned.memory, writes, op.kind in WAITS
        )

    async def _run(self, owned: OwnedShard, op: OwnerOp) -> OwnerAnswer:
        """Decide in memory now (nothing awaited since `local` checked), then wait for the
        writes unless it is a claim."""
        answer, waited = self._decided(owned, op)
        if waited is None:
            return answer
        try:
            async with asyncio.timeout(self._timeout):
                revision = await asyncio.shield(waited)
        except TimeoutError:
            raise StoreUnavailable(f"etcd did not take the {op.kind.name.lower()} in time") from None
        if op.kind is Kind.PUT:
            return OwnerAnswer(answer.retention, number=revision)
        return answer

    async def _owner(self, shard: int) -> OwnerRecord | None:
        """The shard's owner as etcd says (cached a moment for a remote one)."""
        cached = self._remote.get(shard)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        owner = await self._store.owner(shard)
        if owner is not None and owner.replica != self.owners.me.replica:
            self._remote[shard] = (owner, time.monotonic() + OWNER_CACHE_S)
        return owner


def _claim_outcome(a: OwnerAnswer) -> ClaimOutcome:
    """A CLAIM's answer as RetentionStore.claim gives it."""
    return ClaimOutcome(a.retention, earlier=a.claim, marker_revision=a.number)

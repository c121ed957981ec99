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
from typing import Protocol

import structlog

from controlplane import metrics
from controlplane.errors import FailedPrecondition, StoreUnavailable
from controlplane.owners.durable import OwnerStore
from controlplane.owners.ops import WAITS, Kind, OwnerAnswer, OwnerOp, decide, stored_of
from controlplane.owners.owner import OwnedShard, ShardOwners
from controlplane.owners.shards import shard_of
from controlplane.records import Claim, OwnerRecord, Retention
from controlplane.store.retentions import ClaimOutcome, Stored

log = structlog.get_logger(__name__)

OWNER_CACHE_S = 2.0
"""How long a remote owner read from etcd is used before it is read again."""


class NotOwner(FailedPrecondition):
    """A forwarded operation reached a replica that does not own (or no longer owns) the
    shard: the caller reads the owner again."""


class Forwarder(Protocol):
    """Sends an operation to the replica at `address` (the Owners RPC). Raises NotOwner
    when that replica does not own the shard, StoreUnavailable when it does not answer."""

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

    async def claim(
        self, tenant: str, conversation_id: str, now: float, claimed_by: str = ""
    ) -> ClaimOutcome:
        """As RetentionStore.claim: decided by the owner, answered before it is durable."""
        a = await self.apply(OwnerOp(Kind.CLAIM, tenant, conversation_id, now, claimed_by=claimed_by))
        return ClaimOutcome(a.retention, earlier=a.claim, marker_revision=a.number)

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
        """Run `op` at its shard's owner (taking the shard when nobody owns it)."""
        shard = shard_of(op.tenant, op.conversation_id, self.owners.settings.shards)
        deadline = time.monotonic() + self.owners.settings.wait_s
        while True:
            owned = await self.owners.local(shard)
            if owned is not None:
                return await self._run(owned, op)
            owner = await self._owner(shard)
            if owner is None:
                owned = await self.owners.take(shard)
                if owned is not None:
                    return await self._run(owned, op)
            elif owner.replica != self.owners.me.replica and self.forwarder is not None and owner.address:
                try:
                    metrics.FORWARDED.labels(op.kind.name.lower()).inc()
                    return await self.forwarder.apply(owner.address, op, self._timeout)
                except NotOwner:
                    self._remote.pop(shard, None)
                except StoreUnavailable:
                    self._remote.pop(shard, None)  # (read again next time: it may be gone)
                    raise
            elif owner.replica != self.owners.me.replica:
                raise StoreUnavailable(
                    f"shard {shard} is owned by replica {owner.replica}, which has no address"
                )
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"shard {shard}: no owner could take the operation in time")
            self._remote.pop(shard, None)
            await asyncio.sleep(0.02)

    async def apply_local(self, op: OwnerOp) -> OwnerAnswer:
        """Run an operation forwarded by another replica: only when this one owns the shard."""
        shard = shard_of(op.tenant, op.conversation_id, self.owners.settings.shards)
        owned = await self.owners.local(shard)
        if owned is None:
            raise NotOwner(f"replica {self.owners.me.replica} does not own shard {shard}")
        return await self._run(owned, op)

    async def _run(self, owned: OwnedShard, op: OwnerOp) -> OwnerAnswer:
        """Decide in memory now (nothing awaited since `local` checked), then wait for the
        writes unless it is a claim."""
        marker = self.owners.marker() if op.kind is Kind.CLAIM else 0
        answer, writes = decide(owned.memory, op, marker)
        waited = self.owners.writes.add(owned.shard, owned.fence, owned.memory, writes, op.kind in WAITS)
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

"""The owners' records in etcd: taking a shard (its fence), handing it over cleanly,
loading its retentions and markers, and the fenced writes that make memory durable.

A shard's owner key ``owners/<shard>`` lives on its owner's own etcd lease; its
create_revision is the FENCE, and every write for the shard carries the compare
`create_revision(owners/<shard>) == fence`: once the key is gone (the lease lapsed, or
handed over) or another replica created it again, a deposed owner writes nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.etcd import LeaseGone
from controlplane.owners.memory import Conversation, Held, Target, Write
from controlplane.records import (
    Claim,
    Keys,
    OwnerRecord,
    ShardState,
    decode_claim,
    decode_owner,
    decode_retention,
    decode_state,
    encode,
    prefix_end,
)
from controlplane.store.gcleases import GcLeases
from controlplane.store.kv import EtcdKv, absent, decoded, delete_op, get, put_op, range_op
from kvferry.shards import shard_of

HANDOVER_BATCH = 40
"""Shards left in one transaction (two operations each: etcd takes at most 128)."""
LOAD_PAGE = 500
"""Records per read while a shard's retentions are loaded (unclean takeover)."""
KEYS_PAGE = 5000
"""Keys per read while the conversations a shard has in etcd are listed (keys only)."""


@dataclass(frozen=True)
class Taken:
    """A shard this replica just took: its fence, and how the last owner left it."""

    shard: int
    fence: int
    previous: ShardState | None
    """None: never owned before (nothing of it can have been handed out from memory)."""


@dataclass
class Loaded:
    """A shard's records as etcd holds them."""

    retentions: dict[Conversation, Held] = field(default_factory=dict)
    markers: dict[Conversation, Claim] = field(default_factory=dict)


class OwnerKey(NamedTuple):
    """A shard's owner key as etcd has it."""

    record: OwnerRecord
    lease: int
    """The owner's lease."""
    fence: int
    """Its create revision."""


class Deposed(Exception):
    """A fenced write found another fence: these shards are no longer this replica's."""

    def __init__(self, shards: set[int]) -> None:
        super().__init__(f"shards {sorted(shards)} are owned by another replica now")
        self.shards = shards


def fenced(key: bytes, fence: int) -> rpc.Compare:
    """The condition that `key` is still the owner key created at `fence`."""
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=fence)


class OwnerStore:
    """Owner keys, shard states, and a shard's records, in etcd."""

    def __init__(
        self, kv: EtcdKv, keys: Keys, gc: GcLeases, shards: int, sample: Callable[[bytes], None]
    ) -> None:
        """`sample` is told each retention key written (RetentionScans.sample)."""
        self._kv = kv
        self._sample = sample
        self.keys = keys
        self.gc = gc
        self.shards = shards

    async def grant(self, ttl_s: int) -> int:
        """A new ownership lease. -> its id."""
        return await self._kv.grant("owner_lease", ttl_s)

    async def refresh(self, lease: int) -> int:
        """Seconds left on the ownership lease after a keep-alive (0: it is gone)."""
        return await self._kv.refresh(lease)

    async def revoke_lease(self, lease: int) -> None:
        """Revoke the ownership lease (a failure only lets it lapse at its TTL)."""
        await self._kv.revoke_quietly(lease)

    async def take(self, shard: int, lease: int, me: OwnerRecord) -> Taken | None:
        """Take a shard nobody owns, on `lease`. -> its fence, None when it is owned."""
        okey, skey = self.keys.owner(shard), self.keys.shard_state(shard)
        state = encode(ShardState(clean=False, replica=me.replica))
        try:
            resp = await self._kv.txn(
                "owner_take",
                [absent(okey)],
                [range_op(skey), put_op(okey, encode(me), lease), put_op(skey, state)],
                [],
            )
        except LeaseGone as e:
            raise StoreUnavailable(f"the ownership lease lapsed while taking shard {shard}") from e
        if not resp.succeeded:
            return None
        kvs = resp.responses[0].response_range.kvs
        previous = decoded(decode_state, kvs[0]) if kvs else None
        if kvs and previous is None:  # (unreadable: assume the worst)
            previous = ShardState(clean=False)
        return Taken(shard, int(resp.header.revision), previous)

    async def hand_over(self, fences: dict[int, int], me: OwnerRecord) -> set[int]:
        """Leave shards whose writes are all in etcd: each one's state clean and its owner key
        deleted, atomically per shard. -> the shards that were still this replica's to leave."""
        left: set[int] = set()
        shards = sorted(fences)
        for i in range(0, len(shards), HANDOVER_BATCH):
            batch = shards[i : i + HANDOVER_BATCH]
            txns = [self._hand_over_txn(s, fences[s], me) for s in batch]
            resp = await self._kv.txn("owner_hand_over", [], [rpc.RequestOp(request_txn=t) for t in txns], [])
            left |= {s for s, r in zip(batch, resp.responses, strict=True) if r.response_txn.succeeded}
        return left

    def _hand_over_txn(self, shard: int, fence: int, me: OwnerRecord) -> rpc.TxnRequest:
        okey = self.keys.owner(shard)
        state = encode(ShardState(clean=True, replica=me.replica, fence=fence))
        return rpc.TxnRequest(
            compare=[fenced(okey, fence)],
            success=[put_op(self.keys.shard_state(shard), state), delete_op(okey)],
        )

    async def owner_keys(self) -> dict[int, OwnerKey]:
        """Every shard's owner key now (shards without one are absent)."""
        (resp,) = await self._kv.read("owners", get(self.keys.owners, prefix_end(self.keys.owners)))
        out: dict[int, OwnerKey] = {}
        for kv in resp.kvs:
            record = decoded(decode_owner, kv)
            suffix = bytes(kv.key)[len(self.keys.owners) :]
            if record is not None and suffix.isdigit():
                out[int(suffix)] = OwnerKey(record, int(kv.lease), int(kv.create_revision))
        return out

    async def owners(self) -> dict[int, OwnerRecord]:
        """Every shard's owner now (shards without one are absent)."""
        return {shard: key.record for shard, key in (await self.owner_keys()).items()}

    async def release_stray(self, shard: int, fence: int) -> bool:
        """Delete the owner key of a stray shard (its state stays as the take left it:
        unclean, so the next owner spends what it finds). -> whether it was still that key."""
        okey = self.keys.owner(shard)
        resp = await self._kv.txn("owner_release_stray", [fenced(okey, fence)], [delete_op(okey)], [])
        return bool(resp.succeeded)

    async def owner(self, shard: int) -> OwnerRecord | None:
        """The shard's owner now (None: none)."""
        (resp,) = await self._kv.read("owner", get(self.keys.owner(shard)))
        return decoded(decode_owner, resp.kvs[0]) if resp.kvs else None

    async def fetch(self, c: Conversation) -> tuple[Held | None, Claim | None]:
        """One conversation's retention and marker, linearizably (a shard's owner reads it
        when first touched: nobody else writes it since the owner took the shard)."""
        ret, marker = await self._kv.read(
            "owner_fetch",
            get(self.keys.retention(c.tenant, c.conversation_id)),
            get(self.keys.claim(c.tenant, c.conversation_id)),
        )
        r = decoded(decode_retention, ret.kvs[0]) if ret.kvs else None
        claim = decoded(decode_claim, marker.kvs[0]) if marker.kvs else None
        return (Held(r, int(ret.kvs[0].mod_revision)) if r is not None else None), claim

    async def load(self, shards: set[int]) -> dict[int, Loaded]:
        """The retentions and markers of `shards`, read in pages (one pass over each prefix)."""
        out = {s: Loaded() for s in shards}
        async for key, kv in self._pages(self.keys.retentions):
            c, shard = self._conversation(key)
            target = out.get(shard)
            r = decoded(decode_retention, kv) if target is not None else None
            if target is not None and r is not None:
                target.retentions[c] = Held(r, int(kv.mod_revision))
        async for key, kv in self._pages(self.keys.claimed):
            c, shard = self._conversation(key)
            target = out.get(shard)
            claim = decoded(decode_claim, kv) if target is not None else None
            if target is not None and claim is not None:
                target.markers[c] = claim
        return out

    async def present(self, shards: set[int]) -> dict[int, set[Conversation]]:
        """The conversations of `shards` with a retention or a marker in etcd (keys only:
        a lazily read shard reads only those when first touched; any other has none)."""
        out: dict[int, set[Conversation]] = {s: set() for s in shards}
        for prefix in (self.keys.retentions, self.keys.claimed):
            async for key, _ in self._pages(prefix, keys_only=True):
                c, shard = self._conversation(key)
                target = out.get(shard)
                if target is not None:
                    target.add(c)
        return out

    def _conversation(self, key: bytes) -> tuple[Conversation, int]:
        """The conversation of a retention or claim key, and its shard."""
        tenant, conversation_id = self.keys.split_retention(key)
        return Conversation(tenant, conversation_id), shard_of(tenant, conversation_id, self.shards)

    async def _pages(self, prefix: bytes, keys_only: bool = False) -> AsyncIterator[tuple[bytes, Any]]:
        end, start, revision = prefix_end(prefix), prefix, 0
        limit = KEYS_PAGE if keys_only else LOAD_PAGE
        while True:
            req = rpc.RangeRequest(
                key=start, range_end=end, limit=limit, revision=revision, keys_only=keys_only
            )
            resp = await self._kv.range("owner_load", req)
            revision = int(resp.header.revision)
            for kv in resp.kvs:
                yield bytes(kv.key), kv
            if not resp.more or not resp.kvs:
                return
            start = bytes(resp.kvs[-1].key) + b"\0"

    async def write(self, fences: dict[int, int], writes: list[Write], now: float) -> int:
        """The writes of the shards in `fences`, in one transaction fenced on each. -> its
        revision. Raises Deposed (which shards are no longer this replica's) or
        StoreUnavailable."""
        ops = []
        for w in writes:
            key = self._key(w)
            if w.value is None:
                ops.append(delete_op(key))
            else:
                lease = await self.gc.lease_for(w.deadline, now)
                if w.target is Target.RETENTION:
                    self._sample(key)
                ops.append(put_op(key, encode(w.value), lease))
        compare = [fenced(self.keys.owner(s), f) for s, f in sorted(fences.items())]
        resp = await self._kv.txn("owner_write", compare, ops, [])
        if resp.succeeded:
            return int(resp.header.revision)
        raise Deposed(await self._deposed(fences))

    async def _deposed(self, fences: dict[int, int]) -> set[int]:
        """Which of `fences` no longer hold."""
        (resp,) = await self._kv.read("owners", get(self.keys.owners, prefix_end(self.keys.owners)))
        held = {bytes(kv.key): int(kv.create_revision) for kv in resp.kvs}
        gone = {s for s, f in fences.items() if held.get(self.keys.owner(s)) != f}
        if not gone:
            raise StoreUnavailable("a fenced write failed, yet every fence holds: will try again")
        return gone

    def _key(self, w: Write) -> bytes:
        c = w.conversation
        if w.target is Target.RETENTION:
            return self.keys.retention(c.tenant, c.conversation_id)
        return self.keys.claim(c.tenant, c.conversation_id)

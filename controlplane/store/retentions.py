"""Retentions and claim markers in etcd: the writes of the lookup hot path.

A retention lives at ``retentions/<tenant>/<conversation>``; a claim takes it out and
leaves a marker at ``claimed/<tenant>/<conversation>``, in one transaction, so that
of any number of concurrent lookups on any number of replicas exactly one gets it.
Both go on shared GC leases (gcleases.py); the hot writes are group-committed.

The daemon decides claims in the shard owners' memory now (controlplane.owners, which
writes these same keys, fenced); what reads or writes them directly here are the
linearizable `read` (the owners' view checked against etcd, in tests) and the tools and
tests that set records up. `Stored` and `ClaimOutcome` are the answers both share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.records import Claim, Keys, Retention, decode_claim, decode_retention, encode
from controlplane.store.gcleases import GcLeases
from controlplane.store.kv import EtcdKv, absent, decoded, delete_op, exists, get, mod_is, put_op, range_op

CLAIM_SETTLE_PAUSES_S = (0.0, 0.3, 1.0, 2.0)
"""Pauses before each read that settles a claim etcd did not answer (an election takes about
a second); then it counts as not written, and D keeps what it took to its TTL."""


@dataclass(frozen=True)
class Stored:
    """A retention as read from etcd."""

    tenant: str
    conversation_id: str
    retention: Retention
    revision: int


@dataclass(frozen=True)
class ClaimOutcome:
    """What a claim transaction found: the retention it took, or the marker of an earlier claim."""

    taken: Retention | None
    earlier: Claim | None = None
    marker_revision: int = 0
    """The revision of the marker this claim left (0: it took nothing)."""


class RetentionStore:
    """Retentions and their claim markers. One method = one kvferry-level operation."""

    def __init__(
        self, kv: EtcdKv, keys: Keys, gc: GcLeases, sample: Callable[[bytes], None], claim_marker_s: int
    ) -> None:
        """`sample` is told each key registered (RetentionScans.sample: window bounds)."""
        self._kv = kv
        self._keys = keys
        self._gc = gc
        self._sample = sample
        self._batcher = kv.batcher
        self._claim_marker_s = claim_marker_s

    async def put(
        self, tenant: str, conversation_id: str, r: Retention, now: float
    ) -> tuple[int, Retention | None]:
        """Store a retention, replacing the conversation's previous one. -> (revision, the one
        it replaced: never claimed, as a claim takes it out)."""
        key = self._keys.retention(tenant, conversation_id)
        value = encode(r)
        self._sample(key)

        async def write(lease: int) -> tuple[int, Retention | None]:
            put = rpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)
            txn = rpc.TxnRequest(success=[rpc.RequestOp(request_put=put)])
            resp = await self._batcher.submit("put_retention", txn, (key,))
            previous = resp.responses[0].response_put
            # (the retention it replaced: none, or one this version cannot read)
            replaced = decoded(decode_retention, previous.prev_kv) if previous.HasField("prev_kv") else None
            return int(resp.header.revision), replaced

        return await self._gc.write_on_lease(r.expires_at, now, write)

    async def claim(
        self, tenant: str, conversation_id: str, now: float, claimed_by: str = ""
    ) -> ClaimOutcome:
        """Take the conversation's retention out of etcd, atomically, leaving a claim marker
        that names `claimed_by` (the request the claiming lookup is for).

        One transaction: of any number of concurrent callers on any number of
        replicas, exactly one sees the retention; the others see the marker.
        """
        key = self._keys.retention(tenant, conversation_id)
        ckey = self._keys.claim(tenant, conversation_id)
        marker = encode(Claim(claimed_at=now, claimed_by=claimed_by))

        async def write(lease: int) -> rpc.TxnResponse:
            txn = rpc.TxnRequest(
                compare=[exists(key)],
                success=[range_op(key), delete_op(key), put_op(ckey, marker, lease)],
                failure=[range_op(ckey)],
            )
            return await self._batcher.submit("claim", txn, (key, ckey))

        try:
            resp = await self._gc.write_on_lease(now + self._claim_marker_s, now, write)
        except StoreUnavailable:
            settled = await self._settle_claim(key, ckey, marker)
            if settled is None:
                raise
            return settled
        kvs = resp.responses[0].response_range.kvs
        if resp.succeeded and kvs:
            # (a retention another version wrote, unreadable here, is gone all the same: the
            # turn recomputes, and D holds those blocks to their deadline)
            taken = decoded(decode_retention, kvs[0])
            if taken is None:
                return ClaimOutcome(None)
            return ClaimOutcome(taken, marker_revision=int(resp.header.revision))
        if kvs:  # (a marker unreadable here still says the retention was handed out)
            return ClaimOutcome(None, earlier=decoded(decode_claim, kvs[0]) or Claim(claimed_at=now))
        return ClaimOutcome(None)

    async def _settle_claim(self, key: bytes, ckey: bytes, marker: bytes) -> ClaimOutcome | None:
        """A claim etcd did not answer (the member it went to killed, an election) may have
        been written all the same: the retention gone, nobody told (the fault suite lost
        retentions so when an etcd member was killed). -> what it took, read back: the
        marker is this claim's (its value names the request and the time), and the
        retention is read as it was just before the marker's revision (None: not written,
        or etcd still does not answer after CLAIM_SETTLE_PAUSES_S)."""
        for pause in CLAIM_SETTLE_PAUSES_S:
            await asyncio.sleep(pause)
            try:
                (found,) = await self._kv.read("claim_settle", get(ckey))
                if not found.kvs or bytes(found.kvs[0].value) != marker:
                    return None
                revision = int(found.kvs[0].mod_revision)
                (before,) = await self._kv.read(
                    "claim_settle", rpc.RangeRequest(key=key, revision=revision - 1)
                )
            except StoreUnavailable:
                continue
            taken = decoded(decode_retention, before.kvs[0]) if before.kvs else None
            return None if taken is None else ClaimOutcome(taken, marker_revision=revision)
        return None

    async def unclaim(
        self, tenant: str, conversation_id: str, r: Retention, marker_revision: int, now: float
    ) -> bool:
        """Put back a retention `claim` took and remove its marker, unless the conversation
        has a newer retention or another marker by now. -> whether it was put back.

        One past its deadline is not (D has freed its blocks): its deadline's GC lease may
        be gone, and a write naming a lease etcd no longer knows fails its whole batch."""
        if r.expires_at <= now:
            return False
        key = self._keys.retention(tenant, conversation_id)
        ckey = self._keys.claim(tenant, conversation_id)
        value = encode(r)

        async def write(lease: int) -> rpc.TxnResponse:
            txn = rpc.TxnRequest(
                compare=[absent(key), mod_is(ckey, marker_revision)],
                success=[put_op(key, value, lease), delete_op(ckey)],
            )
            return await self._batcher.submit("unclaim", txn, (key, ckey))

        resp = await self._gc.write_on_lease(r.expires_at, now, write)
        return bool(resp.succeeded)

    async def note_claim_deadline(
        self, tenant: str, conversation_id: str, marker_revision: int, claim: Claim
    ) -> bool:
        """Write `claim` (carrying the deadline of the retention taken) over the marker a
        claim left at `marker_revision`, on the marker's own GC lease; not when a later
        claim, a put-back or a revoke changed the marker since. -> whether it was written."""
        ckey = self._keys.claim(tenant, conversation_id)
        put = rpc.PutRequest(key=ckey, value=encode(claim), ignore_lease=True)
        txn = rpc.TxnRequest(
            compare=[mod_is(ckey, marker_revision)], success=[rpc.RequestOp(request_put=put)]
        )
        resp = await self._batcher.submit("claim_deadline", txn, (ckey,))
        return bool(resp.succeeded)

    async def read(self, tenant: str, conversation_id: str) -> tuple[Stored | None, Claim | None]:
        """The conversation's retention and claim marker, linearizably, without touching them."""
        key = self._keys.retention(tenant, conversation_id)
        ret, claimed = await self._kv.read("read", get(key), get(self._keys.claim(tenant, conversation_id)))
        ret_kvs, claim_kvs = ret.kvs, claimed.kvs
        stored = (
            Stored(tenant, conversation_id, decode_retention(ret_kvs[0].value), int(ret_kvs[0].mod_revision))
            if ret_kvs
            else None
        )
        return stored, decode_claim(claim_kvs[0].value) if claim_kvs else None

    async def revoke_exact(self, tenant: str, conversation_id: str, revision: int) -> Retention | None:
        """Delete the conversation's retention only if it is still the one stored at
        `revision` (not claimed, replaced or revoked since), and its claim marker with it,
        as `revoke` does: an older claim whose caller went away puts its retention back
        only while its marker is there (`unclaim`), and must not bring back what a newer
        registration replaced (the history checker found it: tests/history).
        -> the retention deleted, None if it was not there at that revision."""
        key = self._keys.retention(tenant, conversation_id)
        txn = rpc.TxnRequest(
            compare=[mod_is(key, revision)],
            success=[
                rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, prev_kv=True)),
                delete_op(self._keys.claim(tenant, conversation_id)),
            ],
        )
        resp = await self._kv.send_txn("revoke_exact", txn)
        prev = resp.responses[0].response_delete_range.prev_kvs if resp.succeeded else []
        return decoded(decode_retention, prev[0]) if prev else None

    async def revoke(self, tenant: str, conversation_id: str) -> Stored | None:
        """Delete the conversation's retention, and its claim marker in the same
        transaction: a claim whose caller went away puts its retention back only while
        its marker is there (`unclaim`), so a revoke meanwhile is not undone.
        -> the retention deleted, None if there was none."""
        key = self._keys.retention(tenant, conversation_id)
        txn = rpc.TxnRequest(
            success=[
                rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, prev_kv=True)),
                delete_op(self._keys.claim(tenant, conversation_id)),
            ]
        )
        resp = await self._kv.send_txn("revoke", txn)
        prev = resp.responses[0].response_delete_range.prev_kvs
        if not prev:
            return None
        return Stored(tenant, conversation_id, decode_retention(prev[0].value), int(prev[0].mod_revision))

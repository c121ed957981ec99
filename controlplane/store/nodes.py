"""Node records and their liveness in etcd.

A node's record lives at ``nodes/<engine_id>`` (no etcd lease: it outlives the process
as a tombstone that remembers the generation); its liveness key ``alive/<engine_id>``
holds the generation, on one etcd liveness lease per registration that heartbeats
refresh, and the wall-clock time the liveness ends unless a heartbeat comes first: etcd
renews every lease's whole TTL when it restarts (the embedded one restarts with the
daemon), so the lease alone would keep a node registered by hand for a 10-minute
liveness alive 10 more minutes after each restart. The generation floor keeps
generations rising across deleted records.

Every write carries this replica's fence (controlplane.solewriter), and what it wrote goes
to the `observer` (this replica's view of the nodes) as etcd acknowledges it (store.fenced).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog

from controlplane import metrics
from controlplane.errors import Conflict, StoreUnavailable
from controlplane.etcd import LeaseGone
from controlplane.records import Keys, NodeRecord, NodeState, decode_node, encode, prefix_end
from controlplane.solewriter import SoleWriter
from controlplane.store.fenced import FencedWrites, NodeWrites
from controlplane.store.kv import EtcdKv, absent, decoded, delete_op, get, mod_is, on_lease, put_op

log = structlog.get_logger(__name__)


Liveness = tuple[int, float]
"""What a liveness key holds: the generation, and the wall-clock time its liveness ends
(infinity for a key written before it said)."""


_SUSPEND_TRIES = 5
"""Reads of a node's record a suspension makes while the record keeps changing under it
(each change still the same registration)."""


def _liveness_value(generation: int, until: float) -> bytes:
    return b"%d %.3f" % (generation, until)


def _is_alive(rec: NodeRecord, liveness: Liveness | None, now: float) -> bool:
    """The liveness rule: not deregistered, and the liveness key (None = absent) holds the
    record's generation (a key left by an older generation does not count) and a time
    still ahead."""
    if rec.removed_at or rec.suspended_at or liveness is None:
        return False
    generation, until = liveness
    return generation == rec.generation and now < until


def _node_state(
    node_kvs: Sequence[Any], alive_kvs: Sequence[Any], now: float
) -> tuple[NodeState | None, int]:
    """A node record and its liveness key as read -> (state or None, record mod revision)."""
    rec = decoded(decode_node, node_kvs[0]) if node_kvs else None
    if rec is None:  # (no record, or none this version reads: the node counts as gone)
        return None, 0
    return _state(rec, _liveness(alive_kvs[0]) if alive_kvs else None, now), int(node_kvs[0].mod_revision)


def _state(rec: NodeRecord, liveness: Liveness | None, now: float) -> NodeState:
    alive = _is_alive(rec, liveness, now)
    return NodeState(rec, alive, liveness[1] if alive and liveness else 0.0)


def _liveness(kv: Any) -> Liveness | None:
    """What a liveness key holds (None, with a log line, for a value that is none: the node
    counts as not alive, and the other nodes' records still load)."""
    try:
        generation, _, until = (kv.value or b"0").partition(b" ")
        return int(generation), float(until) if until else math.inf
    except ValueError:
        log.warning(
            "etcd.record.undecodable", key=bytes(kv.key).decode("utf-8", "replace"), error="not a liveness"
        )
        return None


def _floor(kvs: Sequence[Any]) -> tuple[int, int]:
    """The generation floor as read -> (value, mod revision); (0, 0) when never written."""
    return (int(kvs[0].value or b"0"), int(kvs[0].mod_revision)) if kvs else (0, 0)


class NodeStore:
    """Node records, their liveness and the generation floor. One method = one operation."""

    def __init__(
        self, kv: EtcdKv, keys: Keys, writer: SoleWriter | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        """`writer`: this replica's standing as a node writer (None: writes carry no fence)."""
        self._kv = kv
        self._keys = keys
        self._writer = writer
        self._clock = clock
        self.fenced = FencedWrites(kv, keys, writer)
        """How every node write is made (store.fenced); its `notices` tell the other replicas."""
        # When each liveness lease this replica wrote or refreshed ends, as its key says.
        self._until: dict[int, float] = {}

    async def load(self) -> tuple[dict[str, NodeState], dict[str, int]]:
        """Every node record with its liveness, and the replicas announced, in one read (the
        replicas go to the SoleWriter). -> (states, node key mod revisions)."""
        k = self._keys
        started = time.monotonic()
        records, lives, *replicas = await self._kv.read(
            "load_nodes",
            get(k.nodes, prefix_end(k.nodes)),
            get(k.alive, prefix_end(k.alive)),
            *([get(k.replicas, prefix_end(k.replicas))] if self._writer is not None else []),
        )
        if self._writer is not None:
            found = {k.replica_id(kv.key): kv.value.decode(errors="replace") for kv in replicas[0].kvs}
            self._writer.saw(found, started, with_view=True)
        alive = {k.engine_of(kv.key): _liveness(kv) for kv in lives.kvs}
        now = self._clock()
        states: dict[str, NodeState] = {}
        revisions: dict[str, int] = {}
        for kv in records.kvs:
            rec = decoded(decode_node, kv)
            if rec is None:
                continue
            states[rec.engine_id] = _state(rec, alive.get(rec.engine_id), now)
            revisions[rec.engine_id] = int(kv.mod_revision)
        return states, revisions

    @property
    def observer(self) -> NodeWrites:
        """Told of each node write this replica made (this replica's view of the nodes)."""
        return self.fenced.observer

    @observer.setter
    def observer(self, observer: NodeWrites) -> None:
        self.fenced.observer = observer

    async def close(self) -> None:
        """Stop settling writes (store.fenced)."""
        await self.fenced.close()

    async def get(self, engine_id: str, serializable: bool = False) -> tuple[NodeState | None, int]:
        """A node's record and liveness, and its record's mod revision (0 = no record);
        `serializable`: see EtcdKv.read."""
        k = self._keys
        record, alive = await self._kv.read(
            "get_node", get(k.node(engine_id)), get(k.alive_key(engine_id)), serializable=serializable
        )
        return _node_state(record.kvs, alive.kvs, self._clock())

    async def get_with_floor(self, engine_id: str) -> tuple[NodeState | None, int, int, int]:
        """`get`, and the generation floor with its mod revision (what a registration of an
        engine id without a record must stay above), in one read."""
        k = self._keys
        record, alive, floor = await self._kv.read(
            "get_node", get(k.node(engine_id)), get(k.alive_key(engine_id)), get(k.generation_floor)
        )
        state, revision = _node_state(record.kvs, alive.kvs, self._clock())
        return state, revision, *_floor(floor.kvs)

    async def put(
        self,
        rec: NodeRecord,
        expect_revision: int,
        floor_revision: int | None = None,
        previous_lease: int = 0,
        demotes: bool = True,
    ) -> tuple[NodeRecord, int]:
        """Store a node record and start a fresh liveness lease for it. -> (the record as
        stored, its mod revision).

        `expect_revision` is the node key's mod revision the caller decided on
        (0 = must not exist), `floor_revision` the generation floor's it decided the
        generation on (None = it did not); a concurrent change raises Conflict. Once
        stored, `previous_lease` (the liveness lease of the registration this replaces,
        0 = none) is revoked. `demotes`: it replaces a record of another generation (see
        controlplane.solewriter: False only when the caller knows it does not).
        """
        k = self._keys
        until = self._clock() + rec.liveness_ttl  # (taken first: etcd's lease ends after it)
        lease = await self._kv.grant("lease_grant", rec.liveness_ttl)
        metrics.NODE_LEASE_GRANTS.inc()
        stored = msgspec.structs.replace(rec, lease_id=lease)
        cmp = [mod_is(k.node(rec.engine_id), expect_revision)]
        if floor_revision is not None:
            cmp.append(mod_is(k.generation_floor, floor_revision))
        writes = [
            put_op(k.node(rec.engine_id), encode(stored)),
            put_op(k.alive_key(rec.engine_id), _liveness_value(rec.generation, until), lease),
        ]
        try:
            resp = await self.fenced.write("put_node", rec.engine_id, cmp, writes, demotes, expect_revision)
        except LeaseGone as e:  # (its TTL ran out before etcd got to the write: etcd is slow)
            raise StoreUnavailable(f"the liveness lease of {rec.engine_id} expired before it was used") from e
        if not resp.succeeded:
            await self._kv.revoke_quietly(lease)
            raise Conflict(f"node {rec.engine_id} changed concurrently")
        self._until[lease] = until
        self.observer.stored(NodeState(stored, True, until), int(resp.header.revision))
        if previous_lease:
            self._until.pop(previous_lease, None)
            await self._kv.revoke_quietly(previous_lease)
        return stored, int(resp.header.revision)

    async def keepalive(self, rec: NodeRecord) -> tuple[int, NodeRecord]:
        """Refresh a node's liveness lease. -> (seconds left, the record as it stands now:
        its lease may be a new one); 0 if the node was re-registered or removed.

        A lapsed liveness lease (etcd outage, long pause) is re-created as long as the
        node record still holds this generation: the engine never restarted, so
        the blocks it holds are still good. The caller keeps the returned record,
        so the next heartbeat refreshes the new lease instead of making another.
        """
        sent = self._clock()
        ttl = await self._kv.refresh(rec.lease_id)
        if ttl:
            await self._extend(rec, sent)
            return ttl, rec
        self._until.pop(rec.lease_id, None)
        current, revision = await self.get(rec.engine_id)
        if current is None or current.record.generation != rec.generation:
            return 0, rec
        if current.record.removed_at or current.record.suspended_at:  # (a late heartbeat: no revival)
            return 0, rec
        if current.record.lease_id != rec.lease_id:  # renewed meanwhile (another stream or replica)
            sent = self._clock()
            ttl = await self._kv.refresh(current.record.lease_id)
            if ttl:
                await self._extend(current.record, sent)
                return ttl, current.record
        renewed, _ = await self.put(current.record, revision, demotes=False)  # (the same generation)
        log.info("node.liveness.renewed", engine_id=rec.engine_id, lease=renewed.lease_id)
        return rec.liveness_ttl, renewed

    async def _extend(self, rec: NodeRecord, sent: float) -> None:
        """Move the liveness key's end a TTL past `sent` (when the keep-alive of its lease
        that etcd just acknowledged was sent: etcd's lease ends after it) once half of it is
        used (every other heartbeat: they come every third of it), on the same lease and
        only while the key is still this registration's (a suspension or deregistration
        deleted it)."""
        if self._until.get(rec.lease_id, 0.0) - sent > rec.liveness_ttl / 2:
            return
        k = self._keys
        until = sent + rec.liveness_ttl
        key = k.alive_key(rec.engine_id)
        put = put_op(key, _liveness_value(rec.generation, until), rec.lease_id)
        try:
            resp = await self.fenced.write(
                "extend_liveness", rec.engine_id, [on_lease(key, rec.lease_id)], [put], demotes=False
            )
        except LeaseGone:  # (ended meanwhile: the next heartbeat renews it)
            return
        if resp.succeeded:
            self._until[rec.lease_id] = until
            self.observer.extended(rec.engine_id, rec.lease_id, until)
        else:
            self._until.pop(rec.lease_id, None)

    async def delete(self, engine_id: str, now: float) -> bool:
        """End a node's liveness and leave a tombstone of its record.

        The tombstone keeps the generation, so a later registration of the same
        engine id gets a newer one and the retentions of this one stay dead.
        """
        state, revision = await self.get(engine_id)
        if state is None or state.record.removed_at:
            return False
        k = self._keys
        tomb = msgspec.structs.replace(state.record, removed_at=now, lease_id=0)
        resp = await self.fenced.write(
            "delete_node",
            engine_id,
            [mod_is(k.node(engine_id), revision)],
            [put_op(k.node(engine_id), encode(tomb)), delete_op(k.alive_key(engine_id))],
            settle_revision=revision,
        )
        if not resp.succeeded:
            raise Conflict(f"node {engine_id} changed concurrently")
        self.observer.stored(NodeState(tomb, False, 0.0), int(resp.header.revision))
        if state.record.lease_id:
            await self._kv.revoke_quietly(state.record.lease_id)
        return True

    async def suspend(self, rec: NodeRecord, now: float) -> tuple[NodeRecord, int] | None:
        """End the liveness of registration `rec` at once, keeping its generation (see
        NodeRecord.suspended_at): only while the node's record is still that registration
        (same generation, same liveness lease), so an Attach stream that ends late never
        suspends the registration that replaced it. A record written meanwhile that is
        still that registration (a heartbeat's renewal in flight) is read again. -> (the
        suspended record, its mod revision), None when there was nothing to suspend."""
        for _ in range(_SUSPEND_TRIES):
            state, revision = await self.get(rec.engine_id)
            if state is None:
                return None
            cur = state.record
            if (
                cur.removed_at
                or cur.suspended_at
                or (cur.generation, cur.lease_id) != (rec.generation, rec.lease_id)
            ):
                return None
            k = self._keys
            held = msgspec.structs.replace(cur, suspended_at=now, lease_id=0)
            resp = await self.fenced.write(
                "suspend_node",
                rec.engine_id,
                [mod_is(k.node(rec.engine_id), revision)],
                [put_op(k.node(rec.engine_id), encode(held)), delete_op(k.alive_key(rec.engine_id))],
                settle_revision=revision,
            )
            if resp.succeeded:
                self.observer.stored(NodeState(held, False, 0.0), int(resp.header.revision))
                await self._kv.revoke_quietly(cur.lease_id)
                return held, int(resp.header.revision)
        raise Conflict(f"node {rec.engine_id} kept changing: not suspended")

    async def collect(self, engine_id: str, expect_revision: int, generation: int) -> bool:
        """Delete a dead node's record, raising the generation floor to its generation in
        the same transaction: an engine id registered afresh later gets a generation above
        every deleted one, so no retention of a deleted record can match a new process.

        Only if the record is unchanged since `expect_revision` and has no liveness key.
        -> whether it was deleted.
        """
        k = self._keys
        (read,) = await self._kv.read("collect_node", get(k.generation_floor))
        floor, floor_revision = _floor(read.kvs)
        resp = await self.fenced.write(
            "collect_node",
            engine_id,
            [
                mod_is(k.node(engine_id), expect_revision),
                absent(k.alive_key(engine_id)),
                mod_is(k.generation_floor, floor_revision),
            ],
            # The floor is only written when it rises: an unchanged one leaves fresh
            # registrations (which compare its revision) nothing to conflict on.
            [delete_op(k.node(engine_id))]
            + ([put_op(k.generation_floor, b"%d" % generation)] if generation > floor else []),
            settle_revision=expect_revision,
        )
        if resp.succeeded:
            self.observer.deleted(engine_id)
        return bool(resp.succeeded)

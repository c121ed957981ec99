"""Nodes attached to this replica: the sidecars' Attach streams, their heartbeats (the
node's liveness), their KV events (the block index Nodes/Score reads) and their counts.

Only the replica a sidecar is attached to holds its index and counts (in memory, never
in etcd); a stream that ends drops them and suspends the node (see
NodeRecord.suspended_at), unless the replica is stopping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import structlog

from controlplane import metrics
from controlplane.attached import AttachedCounts, Beat
from controlplane.blockindex import MAX_BLOCKS_PER_NODE, BlockIndex, IndexUpdate
from controlplane.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, StoreUnavailable
from controlplane.records import NodeRecord, Role
from controlplane.service.background import Background
from controlplane.service.budgets import Budgets, Release
from controlplane.service.nodecache import NodeCache
from controlplane.service.validation import check_id
from controlplane.store.nodes import NodeStore

log = structlog.get_logger(__name__)

_SUSPEND_RETRY_S = 0.1
"""The first pause before a suspension etcd did not take is tried again (doubling)."""
_SUSPEND_RETRY_MAX_S = 1.0
"""The longest pause between tries: a stop waits at most this (and an etcd request)."""


class Attachments:
    """The Attach streams of this replica, and what their sidecars report."""

    def __init__(
        self,
        store: NodeStore,
        nodes: NodeCache,
        background: Background,
        max_id_bytes: int,
        max_hashes: int,
        clock: Callable[[], float],
        budgets: Budgets,
    ) -> None:
        self._store = store
        self._nodes = nodes
        self._background = background
        self._max_id_bytes = max_id_bytes
        self._max_hashes = max_hashes
        self._clock = clock
        self.budgets = budgets
        self.index = BlockIndex()
        self._streams: dict[str, object] = {}  # engine id -> the Attach stream its index follows
        self._reports: dict[str, AttachedCounts] = {}  # engine id -> its stream's last heartbeat's
        self.stopping = False
        """Set when the replica stops: the Attach streams it ends suspend no node."""

    async def attach(
        self, engine_id: str, generation: int, stream: object, wake: Callable[[], None] = lambda: None
    ) -> NodeRecord:
        """Check that a sidecar attaching speaks for the registered generation; `stream`
        (any object, one per Attach stream) is now the one the node's index follows, and
        `wake` is called when releases wait for its sidecar."""
        check_id("hello.engine_id", engine_id, self._max_id_bytes)
        state, _ = await self._store.get(engine_id)
        if state is None or state.record.removed_at:
            raise NotFound(f"node {engine_id} is not registered")
        if state.record.suspended_at:
            raise FailedPrecondition(
                f"node {engine_id} is suspended (its last Attach stream ended): register it"
            )
        if generation != state.record.generation:
            raise FailedPrecondition(
                f"node {engine_id} is registered at generation {state.record.generation}, not {generation}"
            )
        if self._streams.get(engine_id) is not stream:
            # What the previous stream indexed is its sidecar's view: the new one starts
            # from its own reset (or sends no KV events at all).
            self.index.drop(engine_id)
            self._reports.pop(engine_id, None)
        self._streams[engine_id] = stream
        self.budgets.attached(engine_id, wake)
        return state.record

    async def heartbeat(self, rec: NodeRecord) -> tuple[int, NodeRecord]:
        """Keep a node alive. -> (seconds of liveness left, the record to heartbeat next)."""
        ttl, rec = await self._store.keepalive(rec)
        if ttl <= 0:
            raise FailedPrecondition(f"node {rec.engine_id} was re-registered or removed; register again")
        return ttl, rec

    def index_events(self, rec: NodeRecord, update: IndexUpdate, stream: object) -> None:
        """Fold one KV-event batch of an attached node into the block index (a stream the
        node re-attached past sends none: its deltas would spoil the newer one's snapshot)."""
        if self._streams.get(rec.engine_id) is not stream:
            return
        if not self.index.apply(rec.engine_id, update):
            log.warning("index.overflow", engine_id=rec.engine_id, max_blocks=MAX_BLOCKS_PER_NODE)
        metrics.INDEXED_HASHES.inc(len(update.stored) + len(update.removed))

    def report(self, rec: NodeRecord, beat: Beat, stream: object) -> list[Release]:
        """Keep what a heartbeat of an attached node's sidecar counted (in memory), and
        apply the node's retention budget to the pool it reported, in the background (its
        revokes must not hold the heartbeat up: etcd slow, the liveness would lapse; the
        releases go out when ready). -> the releases its sidecar is to make now."""
        if self._streams.get(rec.engine_id) is not stream:
            return []
        self._reports[rec.engine_id] = AttachedCounts(0, beat.uncaptured_turns, beat.unretained_blocks)
        if beat.pool.blocks > 0 and self.budgets.begin(rec.engine_id):
            self._background.spawn(self.budgets.report(rec.engine_id, beat.pool), "retention-budget")
        return self.budgets.take_releases(rec.engine_id)

    def releases(self, rec: NodeRecord, stream: object) -> list[Release]:
        """The releases waiting for the node's sidecar, when `stream` is its current one."""
        if self._streams.get(rec.engine_id) is not stream:
            return []
        return self.budgets.take_releases(rec.engine_id)

    def counts(self, engine_id: str) -> AttachedCounts:
        """What this replica knows of the node from its sidecar."""
        counts = self._reports.get(engine_id, AttachedCounts())
        pool = self.budgets.pool(engine_id)
        return replace(
            counts,
            indexed_blocks=self.index.count(engine_id),
            pool_blocks=pool.blocks if pool else 0,
            pool_usage=pool.usage if pool else 0.0,
            retained_blocks=self.budgets.retained_blocks(engine_id),
        )

    def detach(self, rec: NodeRecord, stream: object) -> None:
        """An Attach stream ended: if the node's index followed it, the index would go stale,
        so drop it (a sidecar that re-attached meanwhile keeps the newer stream's)."""
        if self._streams.get(rec.engine_id) is stream:
            del self._streams[rec.engine_id]
            self.index.drop(rec.engine_id)
            self._reports.pop(rec.engine_id, None)
            self.budgets.forget(rec.engine_id)
        if not self.stopping:
            self._nodes.doubt(rec)
            self._background.spawn(self._suspend(rec), "suspend-node")

    async def _suspend(self, rec: NodeRecord) -> None:
        """Suspend the node an Attach stream spoke for, now that it ended: nobody vouches for
        its engine process until a sidecar registers it again (see NodeRecord.suspended_at;
        a stream a newer registration replaced suspends nothing). Not while this replica
        stops: its sidecars re-register elsewhere. etcd out of reach, it tries again until
        it is back (the liveness may lapse at its TTL meanwhile, which leaves the node dead
        but not suspended: another replica would take a hello for it)."""
        pause = _SUSPEND_RETRY_S
        while True:
            try:
                suspended = await self._store.suspend(rec, self._clock())
                break
            except (StoreUnavailable, Conflict) as e:
                log.warning("node.suspend.failed", engine_id=rec.engine_id, error=str(e), retry_s=pause)
            await asyncio.sleep(pause)
            if self.stopping:
                return
            pause = min(pause * 2, _SUSPEND_RETRY_MAX_S)
        if suspended is not None:  # (in this replica's view already: NodeStore.observer)
            metrics.NODE_REGISTRATIONS.labels("suspended").inc()
            log.info("node.suspended", engine_id=rec.engine_id, generation=rec.generation)

    def score(self, hashes: list[int], role: int) -> list[tuple[str, int]]:
        """Alive nodes (of `role`, 0 = any) by how many leading prompt blocks they cache,
        in this replica's index."""
        if len(hashes) > self._max_hashes:
            raise InvalidArgument(f"block_hashes has {len(hashes)} entries, at most {self._max_hashes}")
        engines = [
            e
            for e, s in self._nodes.snapshot().items()
            if s.alive and (not role or s.record.role == role or s.record.role == Role.BOTH)
        ]
        return self.index.score(engines, hashes)

    def forget(self, engine_id: str) -> None:
        """A node's record was deleted: its index goes too."""
        self.index.drop(engine_id)

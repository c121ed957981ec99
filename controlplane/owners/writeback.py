"""The owners' write-behind: the etcd writes of the decisions made in memory, sent in
the order they were decided, group-committed (what queued while one transaction was in
flight leaves in the next), each transaction fenced on every shard it writes for.

A claim does not wait for its writes; every other operation does (write-through), so
its answer means durable. A transaction etcd did not answer is sent again, as it was
(puts and deletes of final values: sending them twice ends in the same state), before
anything queued after it; a shard deposed meanwhile (Deposed) loses its queued writes,
which the next owner treats as it treats a crash (see controlplane.owners).
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from controlplane import metrics
from controlplane.errors import StoreUnavailable
from controlplane.etcd import LeaseGone
from controlplane.owners.durable import Deposed, OwnerStore
from controlplane.owners.memory import Conversation, ShardMemory, Target, Write
from controlplane.records import Retention
from kvferry.tasks import spawn

log = structlog.get_logger(__name__)

MAX_OPS = 120
"""Most etcd operations in one transaction (etcd refuses more than 128 by default)."""
MAX_BYTES = 1 << 20
"""Most bytes of records in one transaction (etcd refuses a request over its
--max-request-bytes, 1.5 MiB by default: long conversations' retentions are 100s of KiB
each). One decision's writes always go, whatever their size, as they went before owners."""
MAX_INFLIGHT = 1
"""Transactions in flight at once (of different shards). One: what queues while it is at
etcd leaves together in the next, so a busy daemon sends fewer, larger transactions. With
4, at 1,000 lookups/s most left alone, and their etcd calls took the CPU the lookups
needed (stream lookup+claim p99 61 -> 13 ms at 1,000/s, 875 -> 90 ms at 2,000/s)."""
LINGER_S = 0.01
"""Longest the oldest queued write waits for others to leave with it, when nobody waits
for any of them (a claim's writes only): a transaction, with its etcd call and fsync,
costs the same CPU for 2 writes as for 100. At 1,000 lookups/s, 346-629 transactions/s
of ~3 writes each became <100 (bench.daemon's "owner transactions" row). A write someone
waits for (write-through), or a full transaction's worth, leaves at once."""
RETRY_PAUSES_S = (0.02, 0.1, 0.3, 1.0)
"""Pauses before sending again a transaction etcd did not answer (the last one repeats)."""


@dataclass(eq=False)
class _Entry:
    shard: int
    fence: int
    memory: ShardMemory
    writes: list[Write]
    done: asyncio.Future[int] | None
    queued_at: float
    sending: bool = False


class WriteBehind:
    """The queue of durable writes of every shard this replica owns. Up to MAX_INFLIGHT
    transactions at once, never two of one shard: each shard's writes reach etcd in the
    order they were decided."""

    def __init__(
        self, store: OwnerStore, clock: Callable[[], float], deposed: Callable[[set[int]], None]
    ) -> None:
        """`deposed(shards)` is told the shards a fenced write found owned by another."""
        self._store = store
        self._clock = clock
        self._deposed = deposed
        self._queue: list[_Entry] = []
        self._busy: set[int] = set()  # shards with a transaction in flight (or pausing)
        self._inflight = 0
        self._attempt = 0
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()  # a queued write is waited for, or a transaction is full
        self._queued_ops = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[None]] = set()

    def add(
        self, shard: int, fence: int, memory: ShardMemory, writes: list[Write], wait: bool
    ) -> asyncio.Future[int] | None:
        """Queue a decision's writes. -> with `wait`, a future of the revision they are in
        etcd at (StoreUnavailable: deposed first); None otherwise or with nothing to write."""
        if not writes:
            return None
        loop = asyncio.get_running_loop()
        done = loop.create_future() if wait else None
        self._queue.append(_Entry(shard, fence, memory, writes, done, loop.time()))
        # (the queued-writes gauge is set as transactions end, not here: on every claim,
        # its lock cost more than the rest of queueing it)
        self._queued_ops += len(writes)
        if wait or self._queued_ops >= MAX_OPS:
            self._urgent.set()
        self._idle.clear()
        self._wake.set()
        return done

    def drop(self, shards: set[int]) -> None:
        """Forget the queued writes of shards this replica no longer owns."""
        for e in self._queue:
            if e.shard in shards and e.done is not None and not e.done.done():
                e.done.set_exception(StoreUnavailable(f"shard {e.shard} changed owner before its write"))
        self._queue = [e for e in self._queue if e.shard not in shards]
        self._queued_ops = sum(len(e.writes) for e in self._queue)
        self._settled()

    def pending(self, shard: int) -> bool:
        """Whether writes of `shard` are still queued."""
        return any(e.shard == shard for e in self._queue)

    async def flush(self) -> None:
        """Until every write queued so far is in etcd (or dropped)."""
        await self._idle.wait()

    async def run(self) -> None:
        """Send the queue, until cancelled."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self._linger()
                while self._inflight < MAX_INFLIGHT and (batch := self._take()):
                    for e in batch:
                        e.sending = True
                    shards = {e.shard for e in batch}
                    self._busy |= shards
                    self._inflight += 1
                    spawn(self._send(batch, shards), self._tasks)
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def _linger(self) -> None:
        """Until LINGER_S after the oldest unsent write, when nobody waits for any queued
        write and they fill less than a transaction (see LINGER_S)."""
        if self._inflight >= MAX_INFLIGHT:
            return
        self._urgent.clear()
        unsent = [e for e in self._queue if not e.sending]
        if not unsent or any(e.done is not None for e in unsent):
            return
        if sum(len(e.writes) for e in unsent) >= MAX_OPS:
            return
        left = unsent[0].queued_at + LINGER_S - asyncio.get_running_loop().time()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), left)

    def _take(self) -> list[_Entry]:
        """The oldest entries of shards not in flight that fit one transaction (they stay
        queued until written: a failed send is sent again, before anything of its shards)."""
        batch: list[_Entry] = []
        ops = size = 0
        for e in self._queue:
            if e.sending or e.shard in self._busy:
                continue
            e_size = sum(map(_size, e.writes))
            if batch and (ops + len(e.writes) > MAX_OPS or size + e_size > MAX_BYTES):
                break
            batch.append(e)
            ops += len(e.writes)
            size += e_size
        return batch

    async def _send(self, batch: list[_Entry], shards: set[int]) -> None:
        try:
            revision = await self._store.write(
                {e.shard: e.fence for e in batch}, _coalesced(batch), self._clock()
            )
        except Deposed as e:
            log.warning("owners.deposed", shards=sorted(e.shards))
            self._deposed(e.shards)
            self.drop(e.shards)
            self._unsend(batch)
        except (StoreUnavailable, LeaseGone) as e:
            pause = RETRY_PAUSES_S[min(self._attempt, len(RETRY_PAUSES_S) - 1)]
            self._attempt += 1
            log.info("owners.write.retry", error=str(e), attempt=self._attempt, entries=len(batch))
            if isinstance(e, LeaseGone):
                self._store.gc.forget_all()
            await asyncio.sleep(pause)
            self._unsend(batch)
        else:
            self._attempt = 0
            self._written(batch, revision)
        finally:
            self._busy -= shards
            self._inflight -= 1
            self._wake.set()
            self._settled()

    def _unsend(self, batch: list[_Entry]) -> None:
        for e in batch:
            e.sending = False

    def _written(self, batch: list[_Entry], revision: int) -> None:
        n = len(batch)
        if all(map(operator.is_, self._queue[:n], batch)):  # (the usual case: the oldest)
            del self._queue[:n]
            self._queued_ops -= sum(len(e.writes) for e in batch)
        else:  # (some dropped meanwhile, or taken past a busy shard's)
            sent = set(map(id, batch))
            self._queue = [e for e in self._queue if id(e) not in sent]
            self._queued_ops = sum(len(e.writes) for e in self._queue)
        for e in batch:
            e.memory.written(e.writes, revision)
            if e.done is not None and not e.done.done():
                e.done.set_result(revision)

    def _settled(self) -> None:
        metrics.OWNER_WRITES_QUEUED.set(len(self._queue))
        if not self._queue:
            self._idle.set()


def _size(w: Write) -> int:
    """About the bytes `w` adds to a transaction (its key and overhead counted as 256)."""
    v = w.value
    return 256 + (len(v.params) + len(v.digests) if isinstance(v, Retention) else 0)


def _coalesced(batch: list[_Entry]) -> list[Write]:
    """The batch's writes, the last one to each key only (etcd refuses a key written twice
    in one transaction; the last decision is the state memory holds)."""
    last: dict[tuple[Target, Conversation], Write] = {}
    for e in batch:
        for w in e.writes:
            key = (w.target, w.conversation)
            last.pop(key, None)
            last[key] = w
    return list(last.values())

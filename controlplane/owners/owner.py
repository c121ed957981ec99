"""This replica's ownership of claim shards: its ownership lease and the validity it
gives, taking shards (free ones up to a fair share, and any free one an operation
needs), loading them, handing them over cleanly, and the unclean takeover.

Validity: a shard's decisions are made only while `valid()`: until the send time of
the last keep-alive etcd acknowledged, plus the TTL it then had, less a margin
(controlplane.validity). etcd cannot let another replica take the shard before that.
Past it (etcd out of reach, this process paused), nothing is decided; once a keep-alive
is acknowledged again the lease (and so every owner key on it: only this replica
deletes them, fenced) is still there, and deciding goes on with memory as it was. A
lease found gone drops every shard, memory and queued writes: another replica may own
them now.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from controlplane import metrics
from controlplane.errors import StoreUnavailable
from controlplane.owners.durable import Loaded, OwnerKey, OwnerStore, Taken
from controlplane.owners.memory import Conversation, Marked, ShardMemory, Target, Write
from controlplane.owners.shards import fair_share
from controlplane.owners.writeback import WriteBehind
from controlplane.records import OwnerRecord, Retention
from controlplane.settings import OwnerSettings
from controlplane.validity import valid_until
from kvferry.tasks import spawn

log = structlog.get_logger(__name__)
T = TypeVar("T")


@dataclass
class OwnedShard:
    """A shard this replica owns."""

    shard: int
    fence: int
    memory: ShardMemory
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    leaving: bool = False


SWEEP_SLACK_S = 300.0
"""A retention is kept in memory this long past its deadline (answered expired)."""

Spent = Callable[[list[tuple[Conversation, Retention]]], None]
"""Told the retentions an unclean takeover found, once the grace is over."""


class ShardOwners:
    """The shards this replica owns, and the lease they are held on."""

    def __init__(
        self,
        store: OwnerStore,
        settings: OwnerSettings,
        live: Callable[[], int],
        spent: Spent,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`live()`: how many replicas share the shards now (this one included)."""
        self.store = store
        self.settings = settings
        self.live = live
        self._spent = spent
        self._clock = clock
        self.me = OwnerRecord(replica="")
        self.shards: dict[int, OwnedShard] = {}
        self.writes = WriteBehind(store, clock, self._lose)
        self._lease = 0
        self._valid_until = 0.0
        self._valid = asyncio.Event()
        self._markers = itertools.count(time.time_ns())
        self._taking: dict[int, asyncio.Task[OwnedShard | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._started = False
        self._granting = asyncio.Lock()
        self._swept = 0

    def marker(self) -> int:
        """A new claim marker identity (unique in this process; loaded markers carry their
        etcd revisions, far below)."""
        return next(self._markers)

    def valid(self) -> bool:
        """Whether this replica may decide for its shards now."""
        if time.monotonic() < self._valid_until:
            return True
        if self._valid.is_set():
            self._valid.clear()
            log.warning("owners.validity_lapsed", shards=len(self.shards), lease=self._lease)
        return False

    def local_now(self, shard: int) -> OwnedShard | None:
        """The shard when `local` would return it without waiting: owned here, loaded,
        valid and staying. None otherwise (then ask `local`)."""
        owned = self.shards.get(shard)
        if owned is None or owned.leaving or not owned.ready.is_set() or not self.valid():
            return None
        return owned

    async def local(self, shard: int) -> OwnedShard | None:
        """The shard, when this replica owns it, loaded and valid (within wait_s; else
        StoreUnavailable). Nothing awaits after its checks: the caller decides at once."""
        owned = self.shards.get(shard)
        if owned is None:
            return None
        if owned.ready.is_set() and self.valid():  # (the usual case: nothing to wait for)
            return None if owned.leaving else owned
        try:
            async with asyncio.timeout(self.settings.wait_s):
                await owned.ready.wait()
                while not self.valid():
                    await self._valid.wait()
        except TimeoutError:
            raise StoreUnavailable(f"shard {shard}: ownership not confirmed by etcd in time") from None
        return owned if self.shards.get(shard) is owned and not owned.leaving else None

    async def take(self, shard: int) -> OwnedShard | None:
        """Take the shard if nobody owns it (one try at a time per shard). -> it, loaded;
        None when another replica owns it."""
        task = self._taking.get(shard)
        if task is None:
            task = asyncio.ensure_future(self._take_now({shard}))
            self._taking[shard] = task
            task.add_done_callback(lambda _: self._taking.pop(shard, None))
        await asyncio.shield(task)
        return await self.local(shard)

    async def _take_now(self, shards: set[int]) -> OwnedShard | None:
        if self._closing:
            return None
        await self._ensure_lease()
        self.start()
        taken = [t for s in sorted(shards) if s not in self.shards and (t := await self._take_one(s))]
        if not taken:
            return None
        log.info("owners.taken", shards=[t.shard for t in taken], owned=len(self.shards))
        clean = [t for t in taken if t.previous is None or t.previous.clean]
        if clean:
            present = await self._retrying(lambda: self.store.present({t.shard for t in clean}))
            for t in clean:
                self._lazy(t, present[t.shard])
        unclean = [t for t in taken if t.previous is not None and not t.previous.clean]
        if unclean:
            loaded = await self._retrying(lambda: self.store.load({t.shard for t in unclean}))
            for t in unclean:
                self._loaded(t, loaded[t.shard])
        return None

    def _lazy(self, taken: Taken, stored: set[Conversation]) -> None:
        """A shard etcd holds exactly as its last owner left it (cleanly, or never owned):
        each conversation of `stored` (those etcd has records of) is read from etcd when
        first touched (routed.py), not all now."""
        owned = self.shards.get(taken.shard)
        if owned is not None and owned.fence == taken.fence:
            owned.memory.stored = stored
            owned.ready.set()

    async def _take_one(self, shard: int) -> Taken | None:
        taken = await self.store.take(shard, self._lease, self.me)
        if taken is not None:
            self.shards[shard] = OwnedShard(shard, taken.fence, ShardMemory(self.settings.marker_s))
            metrics.OWNED_SHARDS.set(len(self.shards))
            log.debug("owners.taken", shard=shard, fence=taken.fence, previous=str(taken.previous))
        return taken

    async def _retrying(self, read: Callable[[], Awaitable[T]]) -> T:
        """A read of taken shards from etcd (etcd out: tried again; their ops wait
        meanwhile, and time out)."""
        while True:
            try:
                return await read()
            except StoreUnavailable as e:
                log.info("owners.load.retry", error=str(e))
                await asyncio.sleep(0.2)

    def _loaded(self, taken: Taken, loaded: Loaded) -> None:
        """Set a shard taken after an unclean leave from what etcd holds: its markers, and
        no retention: every one found is spent, deleted (fenced, ahead of any other
        write), its blocks released after the grace."""
        owned = self.shards.get(taken.shard)
        if owned is None or owned.fence != taken.fence:
            return
        memory = owned.memory
        memory.markers = {c: Marked(claim, 0) for c, claim in loaded.markers.items()}
        if loaded.retentions:
            spent = [(c, h.retention) for c, h in loaded.retentions.items()]
            deletes = [Write(Target.RETENTION, c, None) for c, _ in spent]
            self.writes.add(taken.shard, taken.fence, memory, deletes, wait=False)
            metrics.FAILOVER_RETENTIONS.inc(len(spent))
            log.warning("owners.failover", shard=taken.shard, spent=len(spent), grace_s=self.settings.grace_s)
            spawn(self._release_later(spent), self._tasks)
        owned.ready.set()

    async def _release_later(self, spent: list[tuple[Conversation, Retention]]) -> None:
        await asyncio.sleep(self.settings.grace_s)
        self._spent(spent)

    async def _ensure_lease(self) -> None:
        """An ownership lease, kept alive and acknowledged (StoreUnavailable otherwise). One
        at a time: two grants at once would leave shards on a lease nobody keeps alive."""
        async with self._granting:
            if not self._lease:
                sent = time.monotonic()
                self._lease = await self.store.grant(self.settings.ttl_s)
                self._confirmed(sent, self.settings.ttl_s)
        if not self.valid():
            await self._keep_alive()
            if not self.valid():
                raise StoreUnavailable("the ownership lease is not confirmed by etcd")

    async def _keep_alive(self) -> None:
        """One keep-alive of the ownership lease; a lease found gone loses every shard."""
        if not self._lease:
            return
        sent = time.monotonic()
        ttl = await self.store.refresh(self._lease)
        if time.monotonic() - sent > self.settings.ttl_s / 4:
            log.warning("owners.keepalive_slow", seconds=round(time.monotonic() - sent, 3), ttl=ttl)
        if ttl > 0:
            self._confirmed(sent, ttl)
            return
        log.warning("owners.lease_gone", shards=sorted(self.shards))
        self._lease = 0
        self._lose(set(self.shards))

    def _confirmed(self, sent: float, ttl: int) -> None:
        self._valid_until = valid_until(sent, ttl, self.settings.margin_s)
        self._valid.set()

    def _lose(self, shards: set[int]) -> None:
        """Forget shards another replica may own now: their memory and queued writes."""
        for s in shards:
            self.shards.pop(s, None)
        self.writes.drop(shards)
        metrics.OWNED_SHARDS.set(len(self.shards))

    def start(self) -> None:
        """Start the write-behind and the loop that keeps the lease alive and the shards
        balanced (once; `close` ends them)."""
        if not self._started and not self._closing:
            self._started = True
            spawn(self.writes.run(), self._tasks)
            spawn(self._keep_alive_loop(), self._tasks)
            spawn(self._balance_loop(), self._tasks)

    async def _keep_alive_loop(self) -> None:
        """Keep the ownership lease alive (its own loop: nothing else may delay it)."""
        while True:
            try:
                await self._keep_alive()
            except StoreUnavailable as e:
                log.info("owners.keepalive_failed", error=str(e))
            except Exception:  # a defect: logged, and tried again
                log.exception("owners.keepalive_crashed")
            await asyncio.sleep(self.settings.ttl_s / 6)

    async def _balance_loop(self) -> None:
        """Sweep memory and balance the shards, every balance_s."""
        while True:
            await asyncio.sleep(self.settings.balance_s)
            try:
                self._sweep()
                # (a replica that owns nothing yet has no lease: balance() takes one)
                if self.valid() or not self._lease:
                    await self.balance()
            except StoreUnavailable as e:
                log.info("owners.balance_failed", error=str(e))
            except Exception:  # a defect: logged, and tried again
                log.exception("owners.balance_crashed")

    def _sweep(self) -> None:
        """Forget what etcd collects by itself (on the GC leases): retentions well past
        their deadline (until then a lookup answers expired), markers past their keep. One
        shard per pass: a pass holds the loop (lookups wait) for as long as it takes."""
        if self.shards:
            self._swept += 1
            owned = self.shards[sorted(self.shards)[self._swept % len(self.shards)]]
            owned.memory.sweep(self._clock(), SWEEP_SLACK_S)

    async def balance(self) -> None:
        """Take free shards up to the fair share; hand over those past it."""
        if self._closing:
            return
        keys = await self.store.owner_keys()
        owned = keys.keys() - await self._release_strays(keys)
        share = fair_share(self.settings.shards, self.live())
        if len(self.shards) > share:
            await self.hand_over(*sorted(self.shards)[share:])
            return
        free = [s for s in range(self.settings.shards) if s not in owned][: share - len(self.shards)]
        if free:
            await self._take_now(set(free))

    async def _release_strays(self, keys: dict[int, OwnerKey]) -> set[int]:
        """Free the shards etcd has as this replica's (on its lease) that it does not hold
        and is not taking: a take whose answer was lost. Else nobody would ever take them,
        and every operation on them would find this replica the owner and wait for it in
        vain. -> the shards freed."""
        freed = set()
        for shard, key in sorted(keys.items()):
            mine = key.lease == self._lease and key.record.replica == self.me.replica
            if self._lease and mine and shard not in self.shards and shard not in self._taking:
                if await self.store.release_stray(shard, key.fence):
                    freed.add(shard)
                log.warning("owners.stray_released", shard=shard, fence=key.fence, released=shard in freed)
        return freed

    async def hand_over(self, *shards: int) -> None:
        """Leave shards cleanly: stop deciding, flush, then mark them clean and free."""
        leaving = {s: self.shards[s] for s in shards if s in self.shards}
        for owned in leaving.values():
            owned.leaving = True
        try:
            async with asyncio.timeout(self.settings.ttl_s):
                while any(self.writes.pending(s) for s in leaving):
                    await self.writes.flush()
            left = await self.store.hand_over(
                {s: o.fence for s, o in leaving.items() if self.shards.get(s) is o}, self.me
            )
        except (StoreUnavailable, TimeoutError) as e:  # (left to lapse with the lease: unclean)
            for owned in leaving.values():
                owned.leaving = False
            log.warning("owners.hand_over_failed", shards=sorted(leaving), error=str(e) or "flush timed out")
            return
        self._lose(set(leaving))
        log.info("owners.handed_over", shards=sorted(leaving), clean=sorted(left))

    async def close(self) -> None:
        """A clean stop: every shard handed over (what fails lapses with the lease, unclean)."""
        self._closing = True
        await self.hand_over(*self.shards)
        log.info("owners.closed", unclean=sorted(self.shards))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._lease:
            await self.store.revoke_lease(self._lease)

"""The retention budget at work: what this replica knows of each decode node's pool and
retentions, the releases it decides (controlplane.budget) and makes.

Held retentions are known from the registrations, claims and revokes this replica
served (a node's sidecar registers its retentions through the replica it is attached
to, which is the one that enforces that node's budget). A retention claimed through
another replica may linger here until it expires: the count is then high, never low,
and its release finds it gone, for the shard's owner is the arbiter of single use:

- a release deletes the retention at its shard's owner first (in memory, then written
  to etcd), only at the revision decided on (`OwnedRetentions.revoke_exact`): one a
  lookup claimed meanwhile, or a newer turn replaced, is left alone and not released;
- only then is D's sidecar told to free the blocks (a ReleaseRetention on its Attach
  stream), so no lookup can be handed blocks that are being freed.

The same stream frees the blocks of a claim's put-back that came too late (`orphaned`:
the retention is out of etcd for good, and nothing else would free them), and of the
retentions a shard's unclean takeover spent (reason failover).

Every release goes out through `queue`, whichever replica decided it: on the node's
stream when its sidecar is attached here, else through the relay (relay.py) to the
replica it is attached to.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from controlplane import metrics
from controlplane.budget import Budget, Held, IntervalSketch, Pool, Reason, idle, releases
from controlplane.errors import StoreUnavailable
from controlplane.owners import OwnedRetentions
from controlplane.owners.memory import Conversation
from controlplane.records import Retention
from controlplane.service.relay import ReleaseRelay

log = structlog.get_logger(__name__)

#: Seconds a release's blocks are taken as free already, whatever D's pool use says.
RELEASE_SETTLE_S = 5.0


@dataclass(frozen=True)
class Release:
    """A revoked retention whose blocks D's sidecar is to free."""

    tenant: str
    conversation_id: str
    params: bytes
    """D's params as registered (a serialized google.protobuf.Struct)."""
    reason: Reason
    expires_at: float
    """The retention's deadline: past it D has freed the blocks, and the release is moot."""


class Budgets:
    """Per decode node: its pool, the retentions it holds, and the releases to send it."""

    def __init__(
        self,
        store: OwnedRetentions,
        budget: Budget,
        clock: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, None], str], object] | None = None,
    ) -> None:
        """`spawn` runs a budget pass in the background (None: only heartbeats start them)."""
        self._store = store
        self._spawn = spawn
        self.budget = budget
        self._clock = clock
        self.sketch = IntervalSketch()
        """The turn intervals seen by this replica's lookups."""
        self._held: dict[str, dict[Conversation, Held]] = {}
        self._blocks: dict[str, int] = {}  # engine -> the blocks of its `_held`
        self._engine_of: dict[Conversation, str] = {}
        self._pools: dict[str, Pool] = {}
        self._pending: dict[str, list[Release]] = {}
        self._ticked: dict[str, float] = {}
        self._attached: dict[str, Callable[[], None]] = {}
        self._running: set[str] = set()
        self._recent: dict[str, list[tuple[float, int]]] = {}  # engine -> (when, blocks) released
        self.relay = ReleaseRelay(self.take_forwarded, clock)
        """The releases of nodes attached elsewhere, until their replica takes them."""

    def attached(self, engine_id: str, wake: Callable[[], None]) -> None:
        """The node's sidecar holds an Attach stream to this replica (releases reach it):
        `wake` has the stream send those waiting."""
        self._attached[engine_id] = wake
        self.relay.attached(engine_id)

    def registered(self, tenant: str, conversation_id: str, r: Retention, revision: int) -> None:
        """A retention was stored (replacing the conversation's previous one)."""
        key = Conversation(tenant, conversation_id)
        self._drop(key)
        held = Held(tenant, conversation_id, r.num_tokens, r.block_size, r.created_at, r.expires_at, revision)
        self._held.setdefault(r.engine_id, {})[key] = held
        self._engine_of[key] = r.engine_id
        self._blocks[r.engine_id] = self._blocks.get(r.engine_id, 0) + held.blocks
        self._over_budget(r.engine_id)

    def _over_budget(self, engine_id: str) -> None:
        """A registration took the node over its budget: a pass now, not at its sidecar's
        next heartbeat (under load, seconds of registrations)."""
        pool = self._pools.get(engine_id)
        if pool is None or self._spawn is None:
            return
        if self._blocks.get(engine_id, 0) > self.budget.share * pool.blocks and self.begin(engine_id):
            self._spawn(self.report(engine_id, pool), "retention-budget")

    def rescanned(self, held: dict[str, list[Held]], since: float) -> None:
        """A scan of etcd that began at `since` read these live retentions per engine: for
        the nodes attached here, they replace what this replica knew (registrations through
        other replicas come in, claims through them go), but for what registered here since
        the scan began, which it may have missed."""
        for engine in self._attached:
            now_held = self._held.get(engine, {})
            fresh = {k: h for k, h in now_held.items() if h.created_at >= since}
            for key in now_held:
                self._engine_of.pop(key, None)
            scanned = {Conversation(h.tenant, h.conversation_id): h for h in held.get(engine, [])}
            self._held[engine] = {**scanned, **fresh}
            self._blocks[engine] = sum(h.blocks for h in self._held[engine].values())
            for key in self._held[engine]:
                self._engine_of[key] = engine

    def claimed(self, tenant: str, conversation_id: str, r: Retention, now: float) -> None:
        """A lookup took the retention: its conversation came back after `now - created_at`."""
        self.sketch.observe(now - r.created_at)
        self._drop(Conversation(tenant, conversation_id))

    def revoked(self, tenant: str, conversation_id: str) -> None:
        """The retention is out of etcd (revoked, released)."""
        self._drop(Conversation(tenant, conversation_id))

    def _drop(self, key: Conversation) -> None:
        engine = self._engine_of.pop(key, None)
        if engine is not None:
            h = self._held.get(engine, {}).pop(key, None)
            if h is not None:
                self._blocks[engine] -= h.blocks

    def retained_blocks(self, engine_id: str) -> int:
        """Blocks the live retentions this replica knows of hold on the node."""
        return self._blocks.get(engine_id, 0)

    def pool(self, engine_id: str) -> Pool | None:
        """The node's pool as its sidecar last reported it (None: never, or unknown)."""
        return self._pools.get(engine_id)

    def forget(self, engine_id: str) -> None:
        """The node's Attach stream ended: its pool facts go, and its unsent releases to the
        relay (they follow its sidecar to the replica it attaches to next)."""
        self._attached.pop(engine_id, None)
        self._pools.pop(engine_id, None)
        self.relay.hold(engine_id, self._pending.pop(engine_id, []))
        self._ticked.pop(engine_id, None)
        self._recent.pop(engine_id, None)
        metrics.forget_pool(engine_id)

    def take_releases(self, engine_id: str) -> list[Release]:
        """The releases for the node's sidecar not sent yet (they are sent now)."""
        return self._pending.pop(engine_id, [])

    def queue(self, engine_id: str, release: Release) -> None:
        """Have the node's sidecar free a revoked retention's blocks: on its stream when it
        is attached here, else through the replica it is attached to (the relay)."""
        metrics.RELEASES.labels(release.reason.value).inc()
        if not self.take_forwarded(engine_id, [release]):
            self.relay.hold(engine_id, [release])

    def take_forwarded(self, engine_id: str, releases: list[Release]) -> bool:
        """Send `releases` on the node's stream when its sidecar is attached here (a
        replica's relay offers them to all). -> whether it is."""
        wake = self._attached.get(engine_id)
        if wake is None:
            return False
        self._pending.setdefault(engine_id, []).extend(releases)
        wake()
        return True

    def begin(self, engine_id: str) -> bool:
        """Whether a `report` of the node may start now (one at a time: a heartbeat while
        the last one's releases are still being revoked starts none)."""
        if engine_id in self._running:
            return False
        self._running.add(engine_id)
        return True

    async def report(self, engine_id: str, pool: Pool) -> None:
        """A heartbeat of the node's sidecar told its pool: count what its retentions held
        since the last one, expire those past their deadline, and release the least valuable
        ones the budget says to, and those idle far past every turn interval seen (started by
        `begin`)."""
        self._running.add(engine_id)
        try:
            await self._report(engine_id, pool)
        except Exception:  # a defect: logged, and the next heartbeat tries again
            log.exception("retention.budget.error", engine_id=engine_id)
        finally:
            self._running.discard(engine_id)

    async def _report(self, engine_id: str, pool: Pool) -> None:
        now = self._clock()
        self._pools[engine_id] = pool
        self._expire(engine_id, now)
        retained = self.retained_blocks(engine_id)
        last = self._ticked.get(engine_id)
        if last is not None and now > last:
            metrics.RETAINED_BLOCK_SECONDS.inc(retained * (now - last))
        self._ticked[engine_id] = now
        metrics.show_pool(engine_id, pool.blocks, pool.usage, retained)
        held = list(self._held.get(engine_id, {}).values())
        stale = idle(held, now, self.sketch, self.budget.idle_factor)
        await self._release_all(engine_id, now, [(h, Reason.IDLE) for h in stale])
        gone = {id(h) for h in stale}
        held = [h for h in held if id(h) not in gone]
        pool_now = self._unsettled(engine_id, pool, now)
        await self._release_all(engine_id, now, releases(pool_now, held, self.budget, now, self.sketch))
        metrics.show_pool(engine_id, pool.blocks, pool.usage, self.retained_blocks(engine_id))

    async def _release_all(self, engine_id: str, now: float, chosen: list[tuple[Held, Reason]]) -> None:
        """Release each one (`_release`), counting what was freed as settling."""
        for h, reason in chosen:
            if await self._release(engine_id, h, reason):
                self._recent.setdefault(engine_id, []).append((now, h.blocks))

    def _unsettled(self, engine_id: str, pool: Pool, now: float) -> Pool:
        """`pool` less the blocks released in the last RELEASE_SETTLE_S: the engine's
        metrics may not show them free yet (its sidecar probes it every second or so, and
        a release takes a prefill node's round trip), and must not be released for twice."""
        recent = [(t, n) for t, n in self._recent.get(engine_id, []) if now - t < RELEASE_SETTLE_S]
        self._recent[engine_id] = recent
        if not recent or pool.blocks <= 0:
            return pool
        return Pool(pool.blocks, max(pool.usage - sum(n for _, n in recent) / pool.blocks, 0.0))

    def _expire(self, engine_id: str, now: float) -> None:
        """Retentions past their deadline: D freed them, and their conversations did not
        come back in time."""
        for key, h in list(self._held.get(engine_id, {}).items()):
            if h.expires_at <= now:
                self._drop(key)
                self.sketch.never()
                metrics.RELEASES.labels(Reason.EXPIRY.value).inc()

    async def _release(self, engine_id: str, h: Held, reason: Reason) -> bool:
        """Revoke one retention in etcd (at the revision decided on), then queue its
        release. -> whether it was released."""
        try:
            taken = await self._store.revoke_exact(h.tenant, h.conversation_id, h.revision)
        except StoreUnavailable as e:
            log.warning("retention.budget.revoke_failed", conversation_id=h.conversation_id, error=str(e))
            return False
        self._drop(Conversation(h.tenant, h.conversation_id))
        if taken is None:  # claimed, replaced or revoked meanwhile: not ours to free
            log.info("retention.budget.gone", conversation_id=h.conversation_id, reason=reason.value)
            return False
        self.queue(engine_id, Release(h.tenant, h.conversation_id, taken.params, reason, taken.expires_at))
        log.info(
            "retention.budget.released",
            engine_id=engine_id,
            tenant=h.tenant,
            conversation_id=h.conversation_id,
            blocks=h.blocks,
            reason=reason.value,
        )
        return True

    def ended(self, tenant: str, conversation_id: str, r: Retention) -> bool:
        """A conversation's end revoked its retention: have D's sidecar free the blocks when
        it is attached here. -> whether it will be told (else the caller frees them: at
        once, sooner than through the replica the node is attached to)."""
        self._drop(Conversation(tenant, conversation_id))
        self.sketch.never()
        if r.engine_id not in self._attached:
            return False
        release = Release(tenant, conversation_id, r.params, Reason.CONVERSATION_END, r.expires_at)
        self.queue(r.engine_id, release)
        return True

    def orphaned(self, tenant: str, conversation_id: str, taken: Retention, params: bytes) -> None:
        """A claim's put-back found its retention (`taken`) place taken (the next turn
        registered, or a revoke came, meanwhile): the retention is out of etcd for good,
        and nothing else pulls or frees its blocks. Have D's sidecar free them (`params`),
        wherever it is attached."""
        self.queue(taken.engine_id, Release(tenant, conversation_id, params, Reason.ORPHAN, taken.expires_at))

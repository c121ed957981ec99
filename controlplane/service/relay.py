"""Releases for decode nodes not attached to this replica: held here until the replica
their sidecar is attached to takes them, or their deadline passes.

Any replica may decide a release (a claim's put-back overtaken, runs where the lookup
ran; a failover, at the shard's new owner; a budget pass whose node's stream ended
meanwhile), but only the replica a node's sidecar holds its Attach stream to can tell it
(budgets.py). So every release goes through one path, `Budgets.queue`: told on the
node's stream when it is attached here, else held in this relay, which offers it to the
other replicas (the daemon-only Owners/Release RPC, `offer`: the one that has the node
attached takes it, the others refuse) and, until one takes it, tries again every
`retry_s`, here too (the node may attach here next). A node's stream that ends with
releases not sent yet hands them back here (`Budgets.forget`): they follow the sidecar to
the replica it attaches to next.

Why in memory, not in etcd: a release is worth something only until its retention's
deadline (D frees the blocks itself then), the replicas that decide it and tell it are
alive and reachable as long as it matters, and a write per release would put etcd on
the path it is meant to relieve (budget pressure, failovers after an etcd outage). What
it costs: the releases a replica holds when it crashes are lost; D frees those blocks at
their TTL, as before.

At least once: an offer whose answer is lost is made again, and two replicas may both
hold a stream of the node for a moment while it moves; D's sidecar drops a release it
has made already (and D takes a second one of freed blocks as a no-op).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from controlplane import metrics

if TYPE_CHECKING:
    from controlplane.service.budgets import Release

log = structlog.get_logger(__name__)

RETRY_S = 1.0
"""Seconds between offers of releases no replica took."""
MAX_HELD = 100_000
"""Releases held at most (beyond it, new ones are dropped: D frees them at their TTL)."""

Offer = Callable[[str, "list[Release]"], Awaitable[bool]]
"""Offer a node's releases to the other replicas -> whether one took them (its sidecar is
attached there). False too when none answered."""
Local = Callable[[str, "list[Release]"], bool]
"""Tell a node's releases on its stream here -> whether it is attached here."""


class ReleaseRelay:
    """The releases of nodes attached elsewhere (or nowhere), until taken."""

    def __init__(
        self, local: Local, clock: Callable[[], float], retry_s: float = RETRY_S, cap: int = MAX_HELD
    ) -> None:
        self._local = local
        self._clock = clock
        self._retry = retry_s
        self._cap = cap
        self._held: dict[str, list[Release]] = {}
        self._count = 0
        self._kick = asyncio.Event()
        self.offer: Offer | None = None
        """The other replicas (None: there are none, or none reachable: only this one)."""

    @property
    def held(self) -> int:
        """Releases waiting for a replica to take them."""
        return self._count

    def hold(self, engine_id: str, releases: list[Release]) -> None:
        """Have `releases` reach the node's sidecar wherever it is attached (offered now)."""
        room = max(self._cap - self._count, 0)
        if len(releases) > room:
            metrics.RELAYED.labels("dropped").inc(len(releases) - room)
            log.warning("release.relay.full", engine_id=engine_id, dropped=len(releases) - room)
            releases = releases[:room]
        if releases:
            self._held.setdefault(engine_id, []).extend(releases)
            self._count += len(releases)
            self._kick.set()

    def attached(self, engine_id: str) -> None:
        """The node's sidecar attached here: what is held for it goes on its stream now."""
        releases = self._take(engine_id)
        if releases and not self._local(engine_id, releases):
            self.hold(engine_id, releases)
        elif releases:
            metrics.RELAYED.labels("local").inc(len(releases))

    async def run(self) -> None:
        """Offer what is held, at once when something new is held, else every `retry_s`,
        until cancelled."""
        while True:
            self._kick.clear()  # (before the round: what is held during it starts the next)
            try:
                await self.deliver()
            except Exception:  # a defect: logged, and the next round tries again
                log.exception("release.relay.error")
            if not self._held:
                await self._kick.wait()
            else:
                try:
                    async with asyncio.timeout(self._retry):
                        await self._kick.wait()
                except TimeoutError:
                    pass

    async def deliver(self) -> None:
        """One round: each node's releases told here if it is attached here, else offered
        to the other replicas; those past their deadline dropped (D freed the blocks)."""
        engines = list(self._held)
        await asyncio.gather(*(self._deliver(e) for e in engines))

    async def _deliver(self, engine_id: str) -> None:
        now = self._clock()
        releases = self._take(engine_id)
        live = [r for r in releases if r.expires_at > now]
        if len(live) < len(releases):
            metrics.RELAYED.labels("expired").inc(len(releases) - len(live))
        if not live:
            return
        if self._local(engine_id, live):
            metrics.RELAYED.labels("local").inc(len(live))
            return
        taken = False
        if self.offer is not None:
            try:
                taken = await self.offer(engine_id, live)
            except Exception:  # (the offer's own failures answer False): a defect, kept
                log.exception("release.relay.offer_error", engine_id=engine_id)
        if taken:
            metrics.RELAYED.labels("forwarded").inc(len(live))
            log.info("release.relay.forwarded", engine_id=engine_id, releases=len(live))
            return
        # (Not attached anywhere that answered: kept, with what was held meanwhile.)
        self._held[engine_id] = live + self._held.get(engine_id, [])
        self._count += len(live)

    def _take(self, engine_id: str) -> list[Release]:
        releases = self._held.pop(engine_id, [])
        self._count -= len(releases)
        return releases

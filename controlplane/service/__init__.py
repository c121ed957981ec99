"""The daemon's domain operations: validate, decide (policy), apply (store).

No gRPC and no generated stubs here: the servicers (controlplane.server) translate
messages to the plain dataclasses of these modules and back. One module per concern:

- validation.py: the input checks, each naming the field (pure);
- nodecache.py: this replica's view of the nodes, and the decisions made on it;
- nodes.py: node registrations (the generation rule), listing, collection;
- attachments.py: the sidecars' Attach streams, heartbeats, KV-event index, counts;
- retentions.py: registering, reading, listing and revoking retentions;
- claims.py: the claim, own-turn and put-back of a retention (one place for all three),
  on the shard owners (controlplane.owners: every retention op runs at its shard's owner);
- held.py: what became of the D requests a sidecar holds pinned (Leases/Held);
- lookups.py: validate -> claim -> decide;
- gauges.py: per-node gauges from a paced scan;
- budgets.py: the retention budget of each decode node attached here (its releases);
- relay.py: releases of nodes attached to another replica, until it takes them;
- background.py: what a stop waits for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

from controlplane.budget import Reason
from controlplane.owners import OwnedRetentions, OwnerStore, ShardOwners
from controlplane.owners.memory import Conversation
from controlplane.records import Retention
from controlplane.service.attachments import Attachments
from controlplane.service.background import Background
from controlplane.service.budgets import Budgets, Release
from controlplane.service.claims import Claims
from controlplane.service.gauges import Gauges
from controlplane.service.held import HeldPins
from controlplane.service.lookups import Lookups
from controlplane.service.nodecache import NodeCache
from controlplane.service.nodes import NodeRegistry
from controlplane.service.retentions import Retentions
from controlplane.settings import Settings
from controlplane.store import EtcdStore

STOP_SETTLE_S = 0.1
"""How long a stop lets the cancelled streams end before it hands the shards over."""


class ControlPlane:
    """Every operation the gRPC API offers, on plain data: one part per concern, on one
    store and one view of the nodes."""

    def __init__(self, store: EtcdStore, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.settings = settings
        self.background = Background()
        self.nodes = NodeCache(store.nodes, settings.nodes.cache_refresh_s, store.writer)
        store.nodes.observer = self.nodes
        lim = settings.limits
        owner_store = OwnerStore(store.kv, store.keys, store.gc, settings.owners.shards, store.scans.sample)
        owning = replace(settings.owners, marker_s=settings.gc.claim_marker_s)
        self.owners = ShardOwners(owner_store, owning, lambda: 1, self._spent, clock)
        self.owned = OwnedRetentions(self.owners, owner_store, None, store.kv.timeout)
        """Retentions and claim markers, decided by their shards' owners (controlplane.owners)."""
        self.budgets = Budgets(self.owned, settings.budget, clock, self.background.spawn)
        self.gauges = Gauges(store.scans, clock, self.budgets.rescanned)
        self.attachments = Attachments(
            store.nodes, self.nodes, self.background, lim.max_id_bytes, lim.max_tokens, clock, self.budgets
        )
        self.registry = NodeRegistry(store.nodes, self.nodes, self.attachments, self.gauges, settings, clock)
        self.retentions = Retentions(store, self.nodes, settings, clock, self.budgets, self.owned)
        self.claims = Claims(self.owned, self.background, clock, self.budgets, self.retentions.still_held)
        self.lookups = Lookups(self.claims, self.owned, self.nodes, settings, clock, self.budgets)
        self.held = HeldPins(self.owned, lim, clock)
        self._clock = clock

    def _spent(self, spent: list[tuple[Conversation, Retention]]) -> None:
        """Release the blocks of retentions an unclean takeover found (reason failover):
        those of a live engine, before their deadline."""
        now = self._clock()
        for c, r in spent:
            if r.expires_at > now:
                release = Release(c.tenant, c.conversation_id, r.params, Reason.FAILOVER, r.expires_at)
                self.budgets.queue(r.engine_id, release)

    def begin_stop(self) -> None:
        """The replica stops: the Attach streams it ends from now on suspend no node (their
        sidecars re-register elsewhere)."""
        self.attachments.stopping = True

    async def settle(self) -> None:
        """Until the claims of callers that went away are put back and the nodes of ended
        streams suspended (a stop waits for them before the store closes)."""
        await self.background.settle()

    async def close(self) -> None:
        """Hand every owned shard over cleanly (its writes flushed first), once the claims
        of the streams the server's stop cancelled are put back: those streams end in
        tasks of their own, a moment after the stop returns, and a put-back after the
        handover would find no owner here (the retention spent)."""
        await asyncio.sleep(STOP_SETTLE_S)
        await self.background.settle()
        await self.owners.close()

"""Where each lookup goes: to the daemon replica owning its conversation's claim shard
(Leases/Routes), which decides it in memory at once. Any other replica forwards it there:
one more hop through two daemons, which beside a second replica put the lookup p99 at
4-6x its targets where the owner alone met them (bench.fsync_tail, "beside a replica").

`ShardRoutes` is the map, pure. `OwnerReplicas` keeps a Replica (a channel and a lookup
stream) per owner the map names, and leaves out an owner a lookup failed on for SHUN_S
(about the ownership lease's TTL: by then its shards have moved, or it is back); its
conversations meanwhile go to the configured replica, which forwards them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvferry.shards import DEFAULT_TENANT, shard_of
from kvferry.v1 import leases_pb2
from router.replica import Replica

SHUN_S = 5.0
"""How long an owner that failed a lookup is left out of the routes."""


@dataclass(frozen=True)
class Owner:
    """A replica that owns shards: where its lookups go."""

    address: str
    """Its gRPC address (advertised)."""
    stream_address: str = ""
    """Its framed stream's ("" = lookups go over gRPC)."""


@dataclass(frozen=True)
class ShardRoutes:
    """Which replica owns each claim shard (shards without a known owner are absent)."""

    shards: int = 0
    owners: Mapping[int, Owner] = field(default_factory=dict)

    def owner(self, tenant: str, conversation_id: str) -> Owner | None:
        """The owner of the conversation's shard (None: not known)."""
        if self.shards <= 0:
            return None
        return self.owners.get(shard_of(tenant or DEFAULT_TENANT, conversation_id, self.shards))


def routes_of(res: leases_pb2.RoutesResponse, framed: bool) -> ShardRoutes:
    """The map a Leases/Routes answer gives. `framed`: the router looks up over framed
    streams, so an owner serving none is left out (its shards go to the configured replica)."""
    owners: dict[int, Owner] = {}
    for o in res.owners:
        if not o.address or (framed and not o.stream_address):
            continue
        owner = Owner(o.address, o.stream_address if framed else "")
        owners.update((shard, owner) for shard in o.shards if shard < res.shards)
    return ShardRoutes(res.shards, owners)


class OwnerReplicas:
    """A Replica per shard owner of the routes learned last."""

    def __init__(self, make: Callable[[Owner], Replica], clock: Callable[[], float] = time.monotonic) -> None:
        """`make`: a new Replica for an owner (or the configured one at its address)."""
        self._make = make
        self._clock = clock
        self.routes = ShardRoutes()
        self._replicas: dict[Owner, Replica] = {}
        self._shunned: dict[str, float] = {}

    def learn(self, routes: ShardRoutes) -> tuple[list[Replica], list[Replica]]:
        """Take `routes` as the map. -> (the replicas made for owners new to it, those of
        owners it no longer names: the caller sets the first up and retires the others)."""
        owners = set(routes.owners.values())
        made = {owner: self._make(owner) for owner in owners - self._replicas.keys()}
        # (all made before any state changes: a `make` that fails leaves the old routes)
        self.routes = routes
        self._replicas.update(made)
        gone = [self._replicas.pop(o) for o in list(self._replicas) if o not in owners]
        return list(made.values()), gone

    def forget(self) -> list[Replica]:
        """Drop every owner's replica (a certificate rotation: they are made anew). -> them."""
        gone = list(self._replicas.values())
        self._replicas.clear()
        self.routes = ShardRoutes()
        return gone

    def replica(self, tenant: str, conversation_id: str) -> Replica | None:
        """The replica of the conversation's owner (None: not known, or shunned)."""
        owner = self.routes.owner(tenant, conversation_id)
        if owner is None:
            return None
        until = self._shunned.get(owner.address)
        if until is not None:
            if self._clock() < until:
                return None
            del self._shunned[owner.address]
        return self._replicas.get(owner)

    def shun(self, address: str) -> None:
        """A lookup failed on the owner at `address`: leave it out for SHUN_S."""
        self._shunned[address] = self._clock() + SHUN_S

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

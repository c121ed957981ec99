"""Whether this replica provably knows every node change since its last read of etcd:
then its own view of the nodes is etcd's, and a lookup decides a pull without reading etcd.

Why it matters. Before a pull, a lookup has its decode node's state confirmed by a read
at most 50 ms old (service/nodecache.py). etcd answers every read of a member, even a
serializable one, only between two backend commits (a commit holds bbolt's read lock
through its fdatasync): with a slow disk, that read is a lookup's whole tail
(bench.fsync_tail). A replica that knows every node write since its last read of etcd
needs no such read.

The rule. Every node write is a daemon replica's etcd transaction (store/nodes.py), and
each carries the FENCE: the writer's own announcement key ``replicas/<id>`` (peers.py)
still on the etcd lease it was announced on. A replica may then trust its view alone
(`trusted`) while

1. its latest linearizable read of the replica set that qualifies (alone, or rule 4) began
   less than `grace_s - margin_s` ago, and read the node records at the same revision
   (NodeStore.load): whatever any replica wrote before that revision is in the view, and
   no replica absent from it can write after it (its fence fails);
2. its own announcement is provably still in etcd (the send time of the last keep-alive
   etcd acknowledged plus the TTL it then had, less `margin_s`): a replica joining later
   finds it (rule 3);
3. each replica, once announced, makes no write that DEMOTES a node (ends its
   liveness or gives it another generation: a suspension, a deregistration, a record
   collected, a registration of a restarted engine) until either its first read of the
   replica set begun after the announcement showed it alone (then no replica
   trusts its view: by rule 2 such a replica's key would have been in that read), or
   `grace_s` has passed since the announcement (a replica that trusted a read without it
   began that read before it, so stops trusting before then). Peers' read of the replica
   set (peers.py) decides this, but it reads no node records: it never makes the view
   trusted (a replica that wrote and left since the view's last load may have written
   what the view lacks). Other writes (a node registered anew as the same process, a new
   node, its liveness moved on) go at once: a view that lacks one only thinks a node less
   alive than it is (reuse skipped until the next load, never a pull it should not make);
4. and every other replica that read found holds to its promise to tell this one of each
   demotion before it writes it (controlplane.notices): a promise that came back before
   the read began (the read has every demotion that replica made before its grant), and
   unbroken since (renewed before it lapsed, as this replica reckons it: from when it sent
   the request, less `margin_s`). A demotion it was told of keeps that node on confirming
   reads (service/doubts.py) until it is over.

Its own writes go into the view when etcd acknowledges them; a write whose outcome is
unknown (a timeout, a cancelled call) puts that node back on confirming reads until a read
covers it (service/doubts.py), and a demoting one until it is settled first (it can apply
no more: store/fenced.py). Liveness ends are the writer's wall-clock times, judged on this
replica's clock: replicas on several machines need their clocks in step (NTP) to well
under a liveness TTL. With one replica (the embedded default) the view is
trusted whenever etcd answered the node refresh (every 0.5 s) in the last 2.5 s; with
several, also while every other replica answers the promise renewals (every 0.5 s). The
costs: a replica that joins others demotes no node (a suspension, say, waits) for
`grace_s` after it announces itself, and each demotion first tells the other replicas.

Clocks: every interval is measured by one process's monotonic clock; `margin_s` covers
two processes' clocks running at different rates over `grace_s` (and over a promise).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

from controlplane.errors import StoreUnavailable
from controlplane.validity import valid_until

GRACE_S = 3.0
"""How long after announcing itself a replica that found others demotes no node (rule 3)."""
MARGIN_S = 0.5
"""What a replica takes off the intervals it trusts its view for (see the module doc)."""


class _Held(NamedTuple):
    """A promise of notice this replica holds (controlplane.notices)."""

    since: float
    """Unbroken since its grant came back (this clock)."""
    until: float
    """Good until (this clock: from when the renewal was asked, less the margin)."""
    grant: int
    """The number of the grant it runs on."""


_NONE = _Held(math.inf, -math.inf, 0)


class SoleWriter:
    """This replica's standing as a writer of node records: the fence its writes carry,
    when it may write, and whether its view of the nodes needs no confirming read."""

    def __init__(
        self,
        grace_s: float = GRACE_S,
        margin_s: float = MARGIN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not grace_s > margin_s >= 0:
            raise ValueError(f"the grace ({grace_s} s) must exceed the margin ({margin_s} s)")
        self.grace_s = grace_s
        self.margin_s = margin_s
        self._clock = clock
        self.me = ""
        self.lease = 0
        """The etcd lease this replica's announcement is on (0: not announced)."""
        self._announced_at = 0.0
        self._valid_until = 0.0
        self._write_from: float | None = None
        self._view_read = -math.inf
        """When the latest read that may make the view trusted began (rules 1 and 4)."""
        self._view_others: frozenset[str] = frozenset()
        """The other replicas that read found: each must keep its promise (rule 4)."""
        self._promises: dict[str, _Held] = {}
        """Replica -> the promise of notice it holds (controlplane.notices)."""
        self.view_replicas: dict[str, str] = {}
        """The replicas the latest read of the node records found: id -> address ("" when
        the read gave none)."""
        self._decided = asyncio.Event()
        self._announcing = asyncio.Event()

    def announced(self, me: str, lease: int, sent: float, ttl_s: float) -> None:
        """This replica announced itself as `me` on `lease` (the request sent at `sent`, on
        this clock): a new standing, decided again from its next read of the replica set."""
        self.me, self.lease = me, lease
        self._announced_at = self._clock()
        self._valid_until = valid_until(sent, ttl_s, self.margin_s)
        self._write_from = None
        self._view_read = -math.inf
        self._decided.clear()
        self._announcing.set()

    def refreshed(self, lease: int, sent: float, ttl_s: float) -> None:
        """A keep-alive of `lease` sent at `sent` was acknowledged with `ttl_s` left (0: the
        lease is gone: no standing until announced again)."""
        if lease != self.lease:
            return
        if ttl_s > 0:
            self._valid_until = max(self._valid_until, valid_until(sent, ttl_s, self.margin_s))
        else:
            self.withdrawn()

    def withdrawn(self) -> None:
        """The announcement is gone (lapsed, or taken away at stop)."""
        self.lease = 0
        self._valid_until = 0.0
        self._write_from = None
        self._view_read = -math.inf
        self._decided.clear()
        self._announcing.clear()

    def saw(self, replicas: Collection[str], started: float, with_view: bool = False) -> None:
        """A linearizable read, begun at `started` (this clock), found these replicas announced
        (a mapping: with their addresses); `with_view`: it read the node records into this
        replica's view at the same revision (only such a read can make the view trusted)."""
        if with_view:
            self.view_replicas = (
                dict(replicas) if isinstance(replicas, Mapping) else dict.fromkeys(replicas, "")
            )
        if not self.lease or started < self._announced_at:
            return  # (begun before this announcement: it says nothing of it)
        others = frozenset(replicas) - {self.me}
        if self._write_from is None:
            alone = set(replicas) == {self.me}
            self._write_from = started if alone else self._announced_at + self.grace_s
            self._decided.set()
        if self.me not in replicas:  # (its own key gone: it trusts nothing until announced again)
            self._view_read = -math.inf
            return
        if not with_view:
            return
        # Each other replica's promise came back before the read began: the read has every
        # demotion that replica made before it, and it tells of every one after (rule 4).
        self._promises = {r: p for r, p in self._promises.items() if r in others}  # (gone: forgotten)
        promised = all(self._promises.get(r, _NONE).since <= started for r in others)
        if promised and started > self._view_read:
            self._view_read, self._view_others = started, others

    @property
    def others(self) -> dict[str, str]:
        """The other replicas the latest read of the node records found: id -> address."""
        return {r: address for r, address in self.view_replicas.items() if r != self.me}

    def promised(self, replica: str, sent: float, seconds: float, grant: int) -> None:
        """`replica` promised notice for `seconds` from its grant number `grant`, asked at
        `sent` (this clock): the promise held goes on when it runs on the same grant (else a
        new one, from now)."""
        held = self._promises.get(replica)
        until = valid_until(sent, seconds, self.margin_s)
        if held is not None and held.grant == grant:
            self._promises[replica] = held._replace(until=max(held.until, until))
        else:
            self._promises[replica] = _Held(self._clock(), until, grant)

    def now(self) -> float:
        """This writer's clock."""
        return self._clock()

    def unpromised(self, replica: str) -> None:
        """`replica` refused to renew its promise, or was found gone."""
        self._promises.pop(replica, None)

    def trusted(self) -> bool:
        """Whether no other replica can have written a node record this replica's view
        lacks, or it was told of it (rules 1, 2 and 4 of the module doc)."""
        now = self._clock()
        return (
            bool(self.lease)
            and now < self._valid_until
            and now < self._view_read + self.grace_s - self.margin_s
            and all(self._kept(r, now) for r in self._view_others)
        )

    def _kept(self, replica: str, now: float) -> bool:
        """Whether `replica`'s promise holds now, unbroken since the view's read began."""
        held = self._promises.get(replica, _NONE)
        return held.since <= self._view_read and now < held.until

    def may_write(self, demotes: bool = True) -> bool:
        """Whether this replica may write node records now: any (announced), or (`demotes`)
        one that demotes a node (rule 3)."""
        if not demotes:
            return bool(self.lease)
        return bool(self.lease) and self._write_from is not None and self._clock() >= self._write_from

    async def fence(self, wait_s: float, demotes: bool = True) -> int:
        """Wait until this replica may make the write (`demotes`: see rule 3), at most
        `wait_s`. -> the lease its announcement key must still be on for it to apply."""
        try:
            async with asyncio.timeout(wait_s):
                while not self.may_write(demotes):
                    if not self.lease:
                        await self._announcing.wait()
                        continue
                    await self._decided.wait()
                    if self._write_from is not None:
                        await asyncio.sleep(max(0.0, self._write_from - self._clock()))
                return self.lease
        except TimeoutError:
            raise StoreUnavailable(
                "this replica may not write node records yet: it is not announced in etcd, or "
                f"it joined other replicas less than {self.grace_s} s ago"
            ) from None

"""A model of daemon replicas keeping node views on one etcd, for the rules of
controlplane.solewriter and controlplane.notices: replicas announce, refresh, read the
nodes, ask each other for promises of notice and demote the one node, each request applied
at one instant between its send and its answer, on one clock (the margin covers clocks'
rates, not modelled). The real SoleWriter and Promises decide; `check` finds a replica
deciding on its own view (trusted, nothing told of and under way) while another replica
wrote after that view was read."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.notices import Promises
from controlplane.solewriter import SoleWriter

TTL = 4.0
PROMISE_S = 2.0
TELL_TIMEOUT_S = 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Etcd:
    keys: dict[str, tuple[int, float]] = field(default_factory=dict)  # replica -> (lease, lapses at)
    writes: list[tuple[float, str]] = field(default_factory=list)  # (applied at, by)
    leases: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def live(self, now: float) -> dict[str, int]:
        return {r: lease for r, (lease, lapses) in self.keys.items() if lapses > now}


@dataclass
class Replica:
    name: str
    writer: SoleWriter
    promises: Promises
    up: bool = True
    """Its process runs (a replica that left is down until it announces again)."""
    loads: list[tuple[float, float, float]] = field(default_factory=list)
    """Its reads of the nodes, (answered, begun, applied): the view is the latest answered."""
    told: dict[tuple[str, int], float] = field(default_factory=dict)
    """Demotions other replicas told of and are not over, and when (service.doubts.Doubts)."""
    ended: set[tuple[str, int]] = field(default_factory=set)
    """Demotions told over (a notice of one that comes later is dropped)."""
    unsure_since: float | None = None
    """A demotion told of was over then: confirmed by a read begun later (Doubts.unsure)."""
    loading: bool = False
    """A read of the nodes is on its way (NodeCache.run makes one at a time)."""

    def decides_alone(self) -> bool:
        """Doubts.sole for the node."""
        return self.writer.trusted() and not self.told and self.unsure_since is None


Action = tuple[int, str, float, float, float]  # replica, what, wait before, to apply, to answer


class Model:
    """Replicas' requests to etcd and to each other, each applied and answered at its own
    later instant; the notices' own delays and losses drawn from `seed`."""

    def __init__(self, replicas: int, seed: int = 0, notices: bool = True) -> None:
        self.clock = Clock()
        self.etcd = Etcd()
        self.replicas = [self._replica(f"r{i}") for i in range(replicas)]
        self.notices = notices
        self.rnd = random.Random(seed)
        self.beside = 0
        """Checks that found a replica deciding alone while another was announced."""
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def _replica(self, name: str) -> Replica:
        return Replica(name, SoleWriter(3.0, 0.5, self.clock), Promises(PROMISE_S, self.clock))

    def run(self, actions: list[Action]) -> None:
        for who, what, wait_s, apply_s, answer_s in actions:
            self.clock.now += wait_s
            while self._events and self._events[0][0] <= self.clock.now:
                at, _, do = heapq.heappop(self._events)
                self.clock.now, saved = at, self.clock.now
                do()
                self.check()
                self.clock.now = saved
            r = self.replicas[who % len(self.replicas)]
            sent = self.clock.now
            getattr(self, what)(r, sent, sent + apply_s, sent + apply_s + answer_s)
            self.check()

    def check(self) -> None:
        for r in self.replicas:
            if not r.up or not r.decides_alone():
                continue
            assert r.loads, (r.name, "trusts a view it never read")
            _, _, applied = max(r.loads)
            others = [(at, by) for at, by in self.etcd.writes if by != r.name and at > applied]
            assert not others, (r.name, self.clock.now, applied, others)
            if set(self.etcd.live(self.clock.now)) - {r.name}:
                self.beside += 1

    def _later(self, at: float, do: Callable[[], None]) -> None:
        heapq.heappush(self._events, (at, next(self._order), do))

    def leave(self, r: Replica, sent: float, applied: float, answered: float) -> None:
        """A clean stop: its key revoked; it may come back as a new process (announce)."""
        lease = r.writer.lease
        r.writer.withdrawn()
        r.up = False

        def revoke() -> None:
            if lease and self.etcd.keys.get(r.name, (0, 0.0))[0] == lease:
                del self.etcd.keys[r.name]

        self._later(applied, revoke)

    def announce(self, r: Replica, sent: float, applied: float, answered: float) -> None:
        if r.writer.lease:
            return
        if not r.up:  # (a new process under that name: nothing carried over)
            fresh = self._replica(r.name)
            self.replicas[self.replicas.index(r)] = r = fresh
        lease = next(self.etcd.leases)

        def put() -> None:
            self.etcd.keys[r.name] = (lease, applied + TTL)

        self._later(applied, put)
        self._later(answered, lambda: r.writer.announced(r.name, lease, sent, TTL))

    def refresh(self, r: Replica, sent: float, applied: float, answered: float) -> None:
        if not r.writer.lease:
            return
        lease, left = r.writer.lease, [0.0]

        def keep() -> None:
            if self.etcd.live(applied).get(r.name) == lease:
                self.etcd.keys[r.name] = (lease, applied + TTL)
                left[0] = TTL

        self._later(applied, keep)
        self._later(answered, lambda: r.writer.refreshed(lease, sent, left[0]))

    def read(self, r: Replica, sent: float, applied: float, answered: float, view: bool = True) -> None:
        """A read of the replica set; `view`: with the node records (NodeStore.load)."""
        seen: dict[str, str] = {}
        writer = r.writer
        if view and r.loading:
            return
        r.loading = r.loading or view

        def answer() -> None:
            if not r.up:
                return  # (asked by a process since gone)
            writer.saw(seen, sent, with_view=view)
            if view:
                r.loading = False
                r.loads.append((self.clock.now, sent, applied))
                r.told = {t: at for t, at in r.told.items() if t[0] in seen or at >= sent}
                if r.unsure_since is not None and r.unsure_since < sent:
                    r.unsure_since = None

        self._later(applied, lambda: seen.update(dict.fromkeys(self.etcd.live(applied), "addr")))
        self._later(answered, answer)

    def look(self, r: Replica, sent: float, applied: float, answered: float) -> None:
        """Peers' read of the replica set alone."""
        self.read(r, sent, applied, answered, view=False)

    def promise(self, r: Replica, sent: float, applied: float, answered: float) -> None:
        """hold_promises: r asks every other replica running for its promise."""
        if not self.notices or not r.writer.lease:
            return
        writer = r.writer
        for o in self.replicas:
            if o is r:
                continue
            got: list[int | None] = []
            at = sent + (applied - sent) * self.rnd.random()

            def grant(o: Replica = o, got: list[int | None] = got) -> None:
                if o.up and o.writer.lease:
                    got.append(o.promises.ask(r.name, "addr"))

            def back(o: Replica = o, got: list[int | None] = got) -> None:
                if not r.up or not got or self.rnd.random() < 0.1:
                    return  # (no answer, or lost: the promise lapses on its own)
                if got[0] is None:
                    writer.unpromised(o.name)
                else:
                    writer.promised(o.name, sent, PROMISE_S, got[0])

            self._later(at, grant)
            self._later(answered, back)

    def write(self, r: Replica, sent: float, applied: float, answered: float) -> None:
        """A write that demotes the node: the promised told first (NoticeSender.before)."""
        if not r.writer.may_write():
            return
        lease, promises = r.writer.lease, r.promises
        demotion = promises.begin("n")
        answered_by: set[str] = set()
        planned: list[float] = []
        for name in demotion.told:
            o = self._by_name(name)
            delivered = sent + 0.3 * self.rnd.random()
            acked = delivered + 0.3 * self.rnd.random()
            if o is None or self.rnd.random() < 0.1 or acked > sent + TELL_TIMEOUT_S:
                continue  # (lost, or late: unanswered)
            planned.append(acked)

            def deliver(o: Replica = o, name: str = name) -> None:
                if o.up and (r.name, demotion.number) not in o.ended:
                    o.told[(r.name, demotion.number)] = self.clock.now
                    answered_by.add(name)

            self._later(delivered, deliver)
        # On once every answer is back, or at the timeout when one will not be.
        told_by = sent
        if demotion.told:
            told_by = max(planned) if len(planned) == len(demotion.told) else sent + TELL_TIMEOUT_S

        def told() -> None:
            if not r.up:  # (its process stopped: nothing more is sent)
                promises.end(demotion)
                return
            for name in list(demotion.told):
                if name not in answered_by:
                    promises.unanswered(demotion, name)
            start = max(self.clock.now, demotion.wait_until)
            txn_applied = start + (applied - sent)
            self._later(txn_applied, apply)
            self._later(txn_applied + (answered - applied), over)

        def apply() -> None:
            if self.etcd.live(self.clock.now).get(r.name) == lease:  # (the fence)
                self.etcd.writes.append((self.clock.now, r.name))

        def over() -> None:
            promises.end(demotion)
            for name in demotion.asked:
                o = self._by_name(name)
                if o is not None and self.rnd.random() >= 0.1:
                    self._later(
                        self.clock.now + 0.2 * self.rnd.random(),
                        lambda o=o: self._demoted(o, r, demotion.number),
                    )

        self._later(told_by, told)

    def _demoted(self, o: Replica, by: Replica, number: int) -> None:
        if o.up:
            o.told.pop((by.name, number), None)
            o.ended.add((by.name, number))
            o.unsure_since = self.clock.now

    def _by_name(self, name: str) -> Replica | None:
        return next((o for o in self.replicas if o.name == name), None)


WHAT = ["announce", "refresh", "refresh", "read", "read", "read", "look", "write", "write", "leave"]
WHAT += ["promise"] * 6 + ["read"] * 2 + ["write"] * 2


def _delay(rnd: random.Random) -> float:
    """How long a request takes to apply, or its answer to come back: mostly quick, now and
    then (a slow disk, a pause) seconds."""
    return rnd.uniform(0, 0.3) if rnd.random() < 0.85 else rnd.uniform(0.3, 2.0)


def schedules(seed: int, count: int) -> list[tuple[list[Action], int]]:
    """Random schedules of 100 actions of 2 or 3 replicas (seeded: the same every run)."""
    rnd = random.Random(seed)
    return [
        (
            [
                (rnd.randrange(3), rnd.choice(WHAT), rnd.uniform(0, 0.25), _delay(rnd), _delay(rnd))
                for _ in range(100)
            ],
            rnd.randint(2, 3),
        )
        for _ in range(count)
    ]


def run(actions: list[Action], replicas: int, seed: int = 0, notices: bool = True) -> Model:
    model = Model(replicas, seed, notices)
    model.run(actions)
    return model

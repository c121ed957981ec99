"""This replica's view of the node records and their liveness, and the lookup decisions
made on it: confirmed by a fresh read before they pull or give the reuse up, unless this
replica provably wrote every node change since its last read (controlplane.solewriter)."""

from __future__ import annotations

import asyncio
import functools
import time

import msgspec
import structlog

from controlplane import metrics
from controlplane.errors import StoreUnavailable
from controlplane.policy import Decision, Policy, Prompt, Reason, decide
from controlplane.records import NodeRecord, NodeState, Retention
from controlplane.service.doubts import Doubts
from controlplane.solewriter import SoleWriter
from controlplane.store.nodes import NodeStore
from kvferry.logs import Outage

log = structlog.get_logger(__name__)

CONFIRM_S = 0.05
"""How old a node's last etcd read may be and still confirm a lookup's pull (a change made
through this replica is in its view at once; through another, within this)."""
KEEP_S = 120.0
"""How long after its last lookup a node's confirming read is kept fresh (`keep_confirmed`):
longer than an agent's turns are apart (its answer decoded, its tools run: tens of seconds),
so that a quiet conversation's next lookup does not wait on etcd either. Measured here, a
kept node costs the daemon and etcd together about 0.5% of a core."""
MAX_KEPT = 4
"""At most this many nodes (the latest looked up) are kept confirmed; others are read when a
lookup needs it, as before."""
KEEP_PACE_S = CONFIRM_S / 5
"""How often a kept node's next confirming read starts while the last one is not back (else
every CONFIRM_S/2): reads overlap, so the window lapses only when etcd takes longer than
CONFIRM_S - KEEP_PACE_S to answer one. One at a time, it lapsed whenever a read took over
~15-25 ms: under load, every few seconds, and every lookup meanwhile waited on etcd."""
MAX_IN_FLIGHT = 8
"""Confirming reads of one node on their way at once, at most (etcd hung: no pile-up)."""
_CONFIRM_WAITS = metrics.LOOKUP_WAITS.labels("node_confirm")


class NodeCache:
    """This replica's view of node records and liveness, at most `refresh_s` stale.

    Lookups decide on it without an extra etcd read; a node missing from the
    view is fetched, and a decision that a node is gone or restarted is checked
    against a fresh read before it is answered (`decision`).
    """

    def __init__(self, store: NodeStore, refresh_s: float, writer: SoleWriter | None = None) -> None:
        """`writer`: this replica's standing as a node writer (None: every pull is confirmed
        by a read). Tell the view of this replica's node writes (NodeStore.observer)."""
        self._store = store
        self._refresh_s = refresh_s
        self.doubts = Doubts(writer)
        self._nodes: dict[str, NodeState] = {}
        self.revisions: dict[str, int] = {}
        """Mod revision of each node's record as last loaded."""
        self.dead_since: dict[str, float] = {}
        """time.monotonic() when this replica first saw each (still) dead node dead."""
        self.loaded_at = 0.0
        self._confirmed_at: dict[str, float] = {}  # engine -> monotonic start of its newest read back
        self._confirming: dict[str, list[tuple[float, asyncio.Future[None]]]] = {}
        """engine -> its confirming reads on their way: (monotonic start, the read), oldest first."""
        self._looked_up: dict[str, float] = {}  # engine -> monotonic time of its last lookup, latest last
        self._lookups_came = asyncio.Event()
        self._doubted: dict[str, tuple[int, int]] = {}
        """engine -> (generation, liveness lease) of a registration whose Attach stream
        ended on this replica (`doubt`)."""

    async def refresh(self) -> dict[str, NodeState]:
        """Read every node from etcd into the view. -> the nodes."""
        known = dict(self.revisions)
        started = time.monotonic()
        nodes, revisions = await self._store.load()
        self.doubts.loaded(started)
        # A record this replica wrote or read while that read was on its way (a
        # re-registration through it, say) may be newer than what the read found: it stays.
        for engine, revision in self.revisions.items():
            moved = revision != known.get(engine)
            if moved and revision > revisions.get(engine, 0) and engine in self._nodes:
                nodes[engine], revisions[engine] = self._nodes[engine], revision
        now = time.monotonic()
        before, seen = self.revisions, self.dead_since
        # A record that changed since (a registration this replica did not see alive)
        # starts its dead time again.
        self.dead_since = {
            e: seen[e] if e in seen and before.get(e) == revisions.get(e) else now
            for e, n in nodes.items()
            if not n.alive
        }
        self._nodes = {e: self._vouched(n) for e, n in nodes.items()}
        self.revisions = revisions
        self.loaded_at = now
        metrics.NODES_ALIVE.set(sum(1 for n in self._nodes.values() if n.alive))
        return dict(self._nodes)

    async def get(self, engine_id: str, fresh: bool = False, confirm: bool = False) -> NodeState | None:
        """A node as the view has it (read from etcd when it has none, when `fresh` is
        asked for, or when the view is four refreshes old). `confirm`: a lookup's check
        (`_confirmed`)."""
        if confirm and not fresh:
            return await self._confirmed(engine_id)
        state = self._nodes.get(engine_id)
        if state is None or fresh or self._stale(time.monotonic()):
            state = await self._read(engine_id)
        return state

    async def _confirmed(self, engine_id: str) -> NodeState | None:
        """The node as etcd had it at most CONFIRM_S ago: read as the etcd member has it
        applied (serializable: not behind etcd's WAL fsync, but behind a backend commit's,
        see controlplane.owners), one read shared by the lookups
        of the same node meanwhile (at 1,000/s on one decode node: 20 reads a second, not
        2,000: the reads were most of a lookup's cost once claims left etcd)."""
        reading = self._confirming_read(engine_id)
        if reading is not None:
            waited = None if reading.done() else time.perf_counter()
            try:
                await asyncio.shield(reading)
            finally:
                if waited is not None:
                    _CONFIRM_WAITS.observe(time.perf_counter() - waited)
        return self._nodes.get(engine_id)

    def confirm_soon(self, engine_id: str) -> None:
        """Start the read that confirms a lookup's pull on `engine_id`, not waiting for it:
        the lookup's decision then finds it done or under way (`_confirmed`)."""
        self._confirming_read(engine_id)

    def _confirming_read(self, engine_id: str) -> asyncio.Future[None] | None:
        """A confirming read of `engine_id` that started less than CONFIRM_S ago (the
        oldest of those on their way: the first back), started if there is none. None: a
        read that recent is back already. A failed read's error goes to whoever awaits it,
        and is not left unretrieved when nobody does."""
        at = time.monotonic()
        if self._fresh(engine_id, at):
            return None
        for started, reading in self._confirming.get(engine_id, ()):
            if at - started < CONFIRM_S:
                return reading
        return self._start_read(engine_id, at)

    def _start_read(self, engine_id: str, at: float) -> asyncio.Future[None]:
        reading = asyncio.ensure_future(self._read_confirming(engine_id, at))
        self._confirming.setdefault(engine_id, []).append((at, reading))
        reading.add_done_callback(functools.partial(self._read_done, engine_id))
        return reading

    def _read_done(self, engine_id: str, done: asyncio.Future[None]) -> None:
        left = [(t, r) for t, r in self._confirming.get(engine_id, ()) if r is not done]
        if left:
            self._confirming[engine_id] = left
        else:
            self._confirming.pop(engine_id, None)
        if not done.cancelled():
            done.exception()  # (retrieved: its awaiters, if any, still get it)

    async def _read_confirming(self, engine_id: str, started: float) -> None:
        """One confirming read, begun at monotonic `started`. Reads overlap and may come
        back out of order: one that began before the newest read back is dropped (a node
        that read found gone must not come back from an older one)."""
        state, revision = await self._store.get(engine_id, serializable=True)
        if started < self._confirmed_at.get(engine_id, 0.0):
            return
        self._apply(engine_id, state, revision)
        self._confirmed_at[engine_id] = started
        self.doubts.read(engine_id, started)

    async def _read(self, engine_id: str) -> NodeState | None:
        """The node read from etcd, linearizably, into the view."""
        state, revision = await self._store.get(engine_id, serializable=False)
        self._apply(engine_id, state, revision)
        return None if state is None else self._vouched(state)

    def _apply(self, engine_id: str, state: NodeState | None, revision: int) -> None:
        if state is not None:
            self.put(state, revision)
        else:
            self._nodes.pop(engine_id, None)

    def put(self, state: NodeState, revision: int) -> None:
        """A node's state as of its record's mod `revision` (an older one is not taken)."""
        engine = state.record.engine_id
        if revision >= self.revisions.get(engine, 0):
            self._nodes[engine], self.revisions[engine] = self._vouched(state), revision

    # What this replica wrote (store.nodes.NodeWrites), as etcd acknowledged it:
    stored = put

    def extended(self, engine_id: str, lease_id: int, until: float) -> None:
        state = self._nodes.get(engine_id)
        if state is not None and state.record.lease_id == lease_id:
            self._nodes[engine_id] = msgspec.structs.replace(state, until=until)

    def deleted(self, engine_id: str) -> None:
        self.drop(engine_id)

    def unsure(self, engine_id: str, settled: bool = True) -> None:
        self.doubts.unsure(engine_id, settled)

    def settled(self, engine_id: str) -> None:
        self.doubts.settled(engine_id)

    def _fresh(self, engine_id: str, at: float) -> bool:
        """Whether a pull on `engine_id` needs no confirming read at monotonic time `at`: one
        began less than CONFIRM_S before, or the view needs none (`Doubts.sole`)."""
        return self._confirmed_within(engine_id, CONFIRM_S, at) or self.doubts.sole(engine_id)

    def doubt(self, rec: NodeRecord) -> None:
        """`rec`'s Attach stream ended on this replica: nobody vouches for its engine
        process now, so this view has that registration not alive from this moment, not
        from when its suspension is through etcd (an fsync away, seconds when etcd is in
        trouble; meanwhile a lookup here would hand out a D in doubt). A registration
        that replaced it (another liveness lease) is not affected."""
        self._doubted[rec.engine_id] = (rec.generation, rec.lease_id)
        state = self._nodes.get(rec.engine_id)
        if state is not None:
            self._nodes[rec.engine_id] = self._vouched(state)

    def _vouched(self, state: NodeState) -> NodeState:
        """`state` as this replica may vouch for it: not alive if its registration is doubted."""
        rec = state.record
        if state.alive and self._doubted.get(rec.engine_id) == (rec.generation, rec.lease_id):
            return NodeState(rec, False)
        return state

    def snapshot(self) -> dict[str, NodeState]:
        """Every node in the view, as a new dict."""
        return dict(self._nodes)

    def drop(self, engine_id: str) -> None:
        """Forget a node (its record was deleted, or could not be read)."""
        self._nodes.pop(engine_id, None)
        self._confirmed_at.pop(engine_id, None)
        self._doubted.pop(engine_id, None)

    async def decision(self, retention: Retention, prompt: Prompt, policy: Policy, now: float) -> Decision:
        """The lookup decision for `retention` on the view of its node. The view may be a
        moment old: unless this replica wrote every node change since its last read
        (`Doubts.sole`), a pull, or giving up the reuse because the node is gone or restarted,
        is confirmed on a fresh read first (a pull must not reach a node suspended or
        registered anew since: another process behind the same engine id, see
        sidecar/identity.py): a read at most CONFIRM_S old, serializable (every node change
        is a daemon replica's etcd write, which an etcd member answers once applied; on
        another member than the writer's, a replication lag later: milliseconds)."""
        self._note_lookup(retention.engine_id)
        node = await self.get(retention.engine_id)
        decided = decide(retention, _at(node, now), prompt, policy, now)
        if _confirmed_first(decided):
            confirmed = await self.get(retention.engine_id, confirm=True)
            if confirmed is not node:  # (the same state, read within CONFIRM_S: decided already)
                decided = decide(retention, _at(confirmed, now), prompt, policy, now)
        return decided

    def decision_now(
        self, retention: Retention, prompt: Prompt, policy: Policy, now: float
    ) -> Decision | None:
        """`decision` when it needs no etcd read: the node in a view that is not stale, and
        a pull (or giving the reuse up) confirmed by a read less than CONFIRM_S old. None
        otherwise (then `decision`, which reads)."""
        engine = retention.engine_id
        node = self._nodes.get(engine)
        at = time.monotonic()
        if node is None or self._stale(at):
            return None
        decided = decide(retention, _at(node, now), prompt, policy, now)
        if _confirmed_first(decided) and not self._fresh(engine, at):
            return None
        self._note_lookup(engine)
        return decided

    def _stale(self, at: float) -> bool:
        """Whether the view is too old at monotonic time `at` to decide on without a read
        (four refreshes: the refresh loop has been held up)."""
        return at - self.loaded_at > 4 * self._refresh_s

    def _confirmed_within(self, engine_id: str, fresh_s: float, at: float) -> bool:
        """Whether a confirming read of `engine_id` started less than `fresh_s` before `at`."""
        confirmed = self._confirmed_at.get(engine_id)
        return confirmed is not None and at - confirmed < fresh_s

    def _note_lookup(self, engine_id: str) -> None:
        """A lookup of `engine_id`: it is the latest for `keep_confirmed` (the oldest of
        more than MAX_KEPT is let go)."""
        self._looked_up.pop(engine_id, None)
        self._looked_up[engine_id] = time.monotonic()
        if len(self._looked_up) > MAX_KEPT:
            del self._looked_up[next(iter(self._looked_up))]
        self._lookups_came.set()

    async def keep_confirmed(self) -> None:
        """Keep the nodes looked up in the last KEEP_S (at most MAX_KEPT of them) confirmed
        by a read less than CONFIRM_S old, so that a lookup finds one back instead of
        waiting for it: 1-3 ms of etcd round trip on a turn that comes after a quiet
        moment, its whole claim's latency on a daemon otherwise deciding in memory, and
        under load, whenever one read was slow, every lookup's. The guarantee is the same
        (a pull decided on a read at most CONFIRM_S old); the cost is a serializable read
        of each such node every 20-30 ms while lookups come, every KEEP_PACE_S while one
        is slow to come back (at most MAX_IN_FLIGHT on their way). A failed read is the
        next lookup's to see."""
        while True:
            if not self._looked_up:
                self._lookups_came.clear()
                await self._lookups_came.wait()
            now = time.monotonic()
            for engine, at in list(self._looked_up.items()):
                if now - at > KEEP_S:
                    del self._looked_up[engine]
                    continue
                if self.doubts.sole(engine):
                    continue  # (no lookup of it waits on a read now)
                on_way = self._confirming.get(engine, [])
                newest = max([self._confirmed_at.get(engine, 0.0), *(t for t, _ in on_way)])
                # Every CONFIRM_S/2 while reads come back at once; every pace while one is out.
                due = KEEP_PACE_S if on_way else CONFIRM_S / 2
                if now - newest >= due - KEEP_PACE_S / 2 and len(on_way) < MAX_IN_FLIGHT:
                    self._start_read(engine, now)
            await asyncio.sleep(KEEP_PACE_S)

    async def run(self) -> None:
        """Refresh every `refresh_s`; an etcd outage is logged when it starts (then once a
        minute) and when it ends, not at every refresh."""
        outage = Outage()
        while True:
            try:
                await self.refresh()
            except StoreUnavailable as e:
                outage.report(log, False, "nodes.refresh.failed", "nodes.refresh.recovered", error=str(e))
            except Exception:  # a defect: logged, and the cache keeps being refreshed
                log.exception("nodes.refresh.error")
            else:
                outage.report(log, True, "nodes.refresh.failed", "nodes.refresh.recovered")
            await asyncio.sleep(self._refresh_s)


def _at(node: NodeState | None, now: float) -> NodeState | None:
    """`node` at wall-clock time `now`: not alive once its liveness has lapsed (a view
    taken when it was alive does not keep it so). Its `until` was taken before the etcd
    lease it is on was granted or last kept alive (store/nodes.py), so etcd's lease ends
    after it: a read at `now` would find the same."""
    if node is None or not node.alive or node.alive_at(now):
        return node
    return NodeState(node.record, False, node.until)


def _confirmed_first(decided: Decision) -> bool:
    """Whether a decision is confirmed on a fresh read of the node before it is answered: a
    pull, or giving the reuse up because the node is gone or restarted (`decision`)."""
    return decided.pull or decided.reason in (Reason.NODE_GONE, Reason.NODE_RESTARTED)

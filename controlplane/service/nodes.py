"""Node registrations: register (with the generation rule), deregister, list, and the
collection of records dead for long."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from controlplane import metrics
from controlplane.attached import AttachedCounts
from controlplane.errors import Conflict, FailedPrecondition, InvalidArgument, StoreUnavailable
from controlplane.nodeurls import NodeNetworks, host_problem, names_to_resolve, node_hosts
from controlplane.records import NodeRecord, NodeState
from controlplane.service.attachments import Attachments
from controlplane.service.gauges import Gauges
from controlplane.service.nodecache import NodeCache
from controlplane.service.validation import check_id, check_node
from controlplane.settings import Settings
from controlplane.store.nodes import NodeStore

log = structlog.get_logger(__name__)

#: Attempts at a registration that loses a race with another one of the same engine id.
_REGISTER_ATTEMPTS = 3
#: Seconds a node's host name gets to resolve (with --node-networks), before it is refused.
RESOLVE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class NodeRegistration:
    """A node registration as asked."""

    record: NodeRecord
    """The record to store: `generation` 0 asks for the next one, `liveness_ttl` 0 for the
    default; `registered_at` and `lease_id` are set when it is stored."""
    no_restart_seen: bool = False
    """The sidecar saw no sign of an engine restart since it started. With generation 0
    and the start time on record, the node keeps its generation: the same process."""


@dataclass(frozen=True)
class ListedNode:
    """A node as Nodes/List reports it."""

    state: NodeState
    held: tuple[int, int] = (0, 0)
    """Live retentions on it and the tokens they hold (the last gauge scan)."""
    counts: AttachedCounts = field(default_factory=AttachedCounts)
    """What its sidecar reported (see controlplane.attached)."""


def next_generation(reg: NodeRegistration, current: NodeState | None, floor: int) -> int:
    """The generation a registration stores, given the node's `current` record and the
    generation floor."""
    asked = reg.record
    previous = current.record.generation if current else 0
    # An engine id without a record (new, or its record was collected) starts above
    # every collected generation: none of their retentions can match it.
    generation = asked.generation or (previous + 1 if current else floor + 1)
    if current is not None and current.record.removed_at:
        # Deregistered: whatever it says, what comes back is a new generation.
        generation = max(generation, previous + 1)
    elif not asked.generation and reg.no_restart_seen and _same_process(current, asked.engine_started_at):
        generation = previous  # its sidecar restarted, not the engine: its blocks are good
    if generation < previous:
        raise FailedPrecondition(
            f"generation {generation} of {asked.engine_id} is older than the registered {previous}"
        )
    return generation


def _same_process(current: NodeState | None, started_at: float) -> bool:
    """Whether a registration is of the engine process `current` records (both know when it
    started, and agree)."""
    return current is not None and started_at > 0 and current.record.engine_started_at == started_at


async def check_hosts(rec: NodeRecord, networks: NodeNetworks) -> None:
    """Refuse a registration naming a host no node can be at (controlplane.nodeurls),
    resolving its names first when there is an allowlist."""
    hosts = node_hosts(rec.http_url, rec.engine_url, rec.side_channel_host)
    names = sorted(names_to_resolve((h for _, h in hosts), networks))
    answers = await asyncio.gather(*map(_resolve, names))
    resolved = dict(zip(names, answers, strict=True))
    for field_name, host in hosts:
        problem = host_problem(field_name, host, networks, resolved)
        if problem:
            log.warning("node.refused", engine_id=rec.engine_id, problem=problem)
            raise InvalidArgument(problem)


async def _resolve(name: str) -> list[str]:
    """Every address `name` resolves to ([] when it does not, within RESOLVE_TIMEOUT_S)."""
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.get_running_loop().getaddrinfo(name, None)
    except (OSError, TimeoutError, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})


class NodeRegistry:
    """The node records: registered, listed, deregistered and, dead long enough, collected."""

    def __init__(
        self,
        store: NodeStore,
        nodes: NodeCache,
        attachments: Attachments,
        gauges: Gauges,
        settings: Settings,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._nodes = nodes
        self._attachments = attachments
        self._gauges = gauges
        self._settings = settings.nodes
        self._limits = settings.limits
        self._clock = clock

    async def register(self, reg: NodeRegistration) -> tuple[NodeRecord, bool]:
        """-> (stored record, restarted: an older generation was replaced)."""
        ttl = check_node(reg.record, self._limits, self._settings.liveness_ttl_s)
        await check_hosts(reg.record, self._settings.networks)
        for attempt in range(_REGISTER_ATTEMPTS):
            try:
                return await self._register_once(reg, ttl)
            except Conflict:
                if attempt == _REGISTER_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _register_once(self, reg: NodeRegistration, ttl: int) -> tuple[NodeRecord, bool]:
        engine = reg.record.engine_id
        current, revision, floor, floor_revision = await self._store.get_with_floor(engine)
        generation = next_generation(reg, current, floor)
        rec = msgspec.structs.replace(
            reg.record, generation=generation, registered_at=self._clock(), liveness_ttl=ttl
        )
        restarted = current is not None and generation != current.record.generation
        stored, _ = await self._store.put(  # (in this replica's view already: NodeStore.observer)
            rec,
            revision,
            None if current else floor_revision,
            previous_lease=current.record.lease_id if current is not None else 0,
            demotes=restarted,
        )
        metrics.NODE_REGISTRATIONS.labels("restarted" if restarted else "ok").inc()
        log.info("node.registered", engine_id=engine, generation=generation, restarted=restarted)
        return stored, restarted

    async def listed(self, role: int, include_dead: bool, fresh: bool = True) -> list[ListedNode]:
        """The nodes, read from etcd (`fresh`) or as this replica last saw them, with what
        this replica knows of them (gauges, their sidecars' counts)."""
        states = await self._nodes.refresh() if fresh else self._nodes.snapshot()
        held = self._gauges.held
        return [
            ListedNode(s, held.get(s.record.engine_id, (0, 0)), self._attachments.counts(s.record.engine_id))
            for s in sorted(states.values(), key=lambda s: s.record.engine_id)
            if not s.record.removed_at and (include_dead or s.alive) and (not role or s.record.role == role)
        ]

    async def deregister(self, engine_id: str) -> bool:
        """End a node's liveness, leaving a tombstone of its record. -> whether it was registered."""
        check_id("engine_id", engine_id, self._limits.max_id_bytes)
        found = await self._store.delete(engine_id, self._clock())
        # A tombstone written is in the view at its revision (NodeStore.observer): a refresh
        # that read the node alive just before cannot bring it back. Nothing written, the
        # view may still hold what etcd no longer has: read it again.
        if not found:
            try:
                await self._nodes.get(engine_id, fresh=True)
            except StoreUnavailable:
                self._nodes.drop(engine_id)
        log.info("node.deregistered", engine_id=engine_id, found=found)
        return found

    async def collect_dead(self) -> int:
        """Delete the records of nodes dead for `nodes.gc_after_s`: deregistered that long
        ago, or seen without liveness by this replica for that long. -> how many."""
        after = self._settings.gc_after_s
        wall, mono = self._clock(), time.monotonic()
        collected = 0
        for engine, state in self._nodes.snapshot().items():
            rec = state.record
            if state.alive:
                continue
            dead_s = (
                wall - rec.removed_at if rec.removed_at else mono - self._nodes.dead_since.get(engine, mono)
            )
            revision = self._nodes.revisions.get(engine)
            if dead_s < after or revision is None:
                continue
            if await self._store.collect(engine, revision, rec.generation):
                self._nodes.drop(engine)
                self._attachments.forget(engine)
                collected += 1
                metrics.NODES_COLLECTED.inc()
                log.info("node.collected", engine_id=engine, generation=rec.generation, dead_s=round(dead_s))
        return collected

    async def run_gc(self, interval_s: float) -> None:
        """Collect dead nodes every `interval_s`, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.collect_dead()
            except StoreUnavailable as e:
                log.warning("nodes.collect.failed", error=str(e))
            except Exception:  # a defect: logged, and the next pass runs all the same
                log.exception("nodes.collect.error")

"""Domain operations of the daemon: validate, decide (policy), apply (store).

No gRPC and no generated stubs here: the servicers in server.py translate
messages to the plain dataclasses below and back.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog

from controlplane import metrics
from controlplane.attached import AttachedCounts
from controlplane.blockindex import MAX_BLOCKS_PER_NODE, BlockIndex, IndexUpdate
from controlplane.convert import remote_request_of
from controlplane.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, StoreUnavailable
from controlplane.policy import (
    RELEASE,
    Decision,
    Prompt,
    Reason,
    decide,
    decide_claimed,
    digest_problem,
    holds_null_blocks,
    param_problems,
)
from controlplane.records import Claim, NodeRecord, NodeState, Retention, Role
from controlplane.settings import MAX_LIVENESS_TTL_S, MIN_LIVENESS_TTL_S, Settings
from controlplane.store import EtcdStore
from controlplane.store.retentions import ClaimOutcome
from kvferry.framing import MESSAGE_BUDGET
from kvferry.ids import id_problem
from kvferry.logs import Outage
from kvferry.urls import is_http_url

log = structlog.get_logger(__name__)

DEFAULT_TENANT = "default"
MAX_PAGE = 1000
MAX_URL_BYTES = 2048
#: Generations stay below this: increments of a registered one must fit a uint64 (and an int64).
MAX_GENERATION = 2**62


@dataclass(frozen=True)
class NodeRegistration:
    engine_id: str
    role: int
    model: str
    block_size: int
    http_url: str
    side_channel_host: str
    side_channel_port: int
    generation: int
    liveness_ttl_s: int
    engine_url: str = ""
    engine_started_at: float = 0.0
    """When the engine process started (0 = unknown)."""
    no_restart_seen: bool = False
    """The sidecar saw no sign of an engine restart since it started. With generation 0
    and the start time on record, the node keeps its generation: the same process."""


@dataclass(frozen=True)
class LeaseRegistration:
    tenant: str
    conversation_id: str
    engine_id: str
    # D's params, parsed (for validation) and as received on the wire (what is stored).
    params: dict[str, Any]
    params_blob: bytes
    num_tokens: int
    expires_at: float | None
    block_size: int
    digests: bytes
    generation: int
    request_id: str = ""


@dataclass(frozen=True)
class LookupQuery:
    tenant: str
    conversation_id: str
    prompt_tokens: int
    prompt_digests: bytes | None  # None: not given (an unverified pull; see policy.Prompt)
    peek: bool
    request_id: str = ""


@dataclass(frozen=True)
class LookupResult:
    decision: Decision
    claimed: bool
    # The retention's stored params, to which decision.params / decision.release apply.
    params_blob: bytes = b""


@dataclass(frozen=True)
class LeaseView:
    """A lease as Get/List/Register report it."""

    tenant: str
    conversation_id: str
    retention: Retention | None
    revision: int = 0
    claim: Claim | None = None


#: A listed lease's encoded bytes beyond its params and digests (ids, times, numbers).
_LEASE_OVERHEAD = 256
#: Most retentions one List call reads: with a filter few match (an engine's among 100k),
#: the page ends short, even empty, with a token to go on from, not after the whole store.
LIST_EXAMINED = 2000

#: How long a Lookup sent with prompt_follows waits for its prompt.
PROMPT_WAIT_S = 10.0


class NodeCache:
    """This replica's view of node records and liveness, at most `refresh_s` stale.

    Lookups decide on it without an extra etcd read; a node missing from the
    view is fetched, and a decision that a node is gone or restarted is checked
    against a fresh read before it is answered (see ControlPlane.lookup).
    """

    def __init__(self, store: EtcdStore, refresh_s: float) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._nodes: dict[str, NodeState] = {}
        self.revisions: dict[str, int] = {}
        """Mod revision of each node's record as last loaded."""
        self.dead_since: dict[str, float] = {}
        """time.monotonic() when this replica first saw each (still) dead node dead."""
        self.loaded_at = 0.0

    async def refresh(self) -> dict[str, NodeState]:
        known = dict(self.revisions)
        nodes, revisions = await self._store.nodes.load()
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
        self._nodes, self.revisions = nodes, revisions
        self.loaded_at = now
        metrics.NODES_ALIVE.set(sum(1 for n in nodes.values() if n.alive))
        return nodes

    async def get(self, engine_id: str, fresh: bool = False) -> NodeState | None:
        state = self._nodes.get(engine_id)
        if state is None or fresh or time.monotonic() - self.loaded_at > 4 * self._refresh_s:
            state, revision = await self._store.nodes.get(engine_id)
            if state is not None:
                self.put(state, revision)
            else:
                self._nodes.pop(engine_id, None)
        return state

    def put(self, state: NodeState, revision: int) -> None:
        """A node's state as of its record's mod `revision` (an older one is not taken)."""
        engine = state.record.engine_id
        if revision >= self.revisions.get(engine, 0):
            self._nodes[engine], self.revisions[engine] = state, revision

    def snapshot(self) -> dict[str, NodeState]:
        return dict(self._nodes)

    def drop(self, engine_id: str) -> None:
        self._nodes.pop(engine_id, None)

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


def _same_process(current: NodeState | None, started_at: float) -> bool:
    """Whether a registration is of the engine process `current` records (both know when it
    started, and agree)."""
    return current is not None and started_at > 0 and current.record.engine_started_at == started_at


def _check_id(name: str, value: str, max_bytes: int, required: bool = True) -> None:
    if not value:
        if required:
            raise InvalidArgument(f"{name} is required")
        return
    problem = id_problem(name, value, max_bytes)
    if problem:
        raise InvalidArgument(problem)


_Claimed = tuple[ClaimOutcome, bool]
_OWN_TURN = Decision(False, Reason.OWN_TURN, "registered for this same request: left to the next turn")


class ControlPlane:
    """Every operation the gRPC API offers, on plain data."""

    def __init__(self, store: EtcdStore, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.settings = settings
        self.nodes = NodeCache(store, settings.nodes.cache_refresh_s)
        self._clock = clock
        self._limits = settings.limits
        # Per engine: (live retentions, held tokens), from the last gauge scan.
        self.held: dict[str, tuple[int, int]] = {}
        self.index = BlockIndex()
        self._streams: dict[str, object] = {}  # engine id -> the Attach stream its index follows
        self._reports: dict[str, AttachedCounts] = {}  # engine id -> its stream's last heartbeat's
        self._putting_back: set[asyncio.Task[None]] = set()  # see _put_back
        self._claiming: set[asyncio.Future[_Claimed]] = set()  # claims sent before their prompt
        self.stopping = False
        """Set when the replica stops: the Attach streams it ends suspend no node."""

    # -- nodes ----------------------------------------------------------------

    async def register_node(self, reg: NodeRegistration) -> tuple[NodeRecord, bool]:
        """-> (stored record, restarted: an older generation was replaced)."""
        _check_id("engine_id", reg.engine_id, self._limits.max_id_bytes)
        if reg.role not in (Role.PREFILL, Role.DECODE, Role.BOTH):
            raise InvalidArgument(f"role {reg.role} is not PREFILL, DECODE or BOTH")
        if not 0 < reg.block_size <= 4096:
            raise InvalidArgument(f"block_size {reg.block_size} must be in 1..4096")
        if not 0 < reg.side_channel_port < 65536:
            raise InvalidArgument(f"side_channel_port {reg.side_channel_port} is not a port number")
        _check_id("side_channel_host", reg.side_channel_host, self._limits.max_id_bytes)
        _check_id("model", reg.model, self._limits.max_id_bytes, required=False)
        for name, url in (("http_url", reg.http_url), ("engine_url", reg.engine_url)):
            if len(url.encode()) > MAX_URL_BYTES:
                raise InvalidArgument(f"{name} is longer than {MAX_URL_BYTES} bytes")
            if url and not is_http_url(url):
                raise InvalidArgument(f"{name} {url!r} must be an http:// or https:// URL with a host")
        ttl = reg.liveness_ttl_s or self.settings.nodes.liveness_ttl_s
        if not MIN_LIVENESS_TTL_S <= ttl <= MAX_LIVENESS_TTL_S:
            raise InvalidArgument(
                f"liveness_ttl_seconds {ttl} must be in {MIN_LIVENESS_TTL_S}..{MAX_LIVENESS_TTL_S}"
            )
        if not (math.isfinite(reg.engine_started_at) and reg.engine_started_at >= 0):
            raise InvalidArgument(f"engine_started_at {reg.engine_started_at} must be a time (or 0)")
        if reg.generation >= MAX_GENERATION:
            # (the next one, previous + 1, must still fit the API's uint64)
            raise InvalidArgument(f"generation {reg.generation} must be below {MAX_GENERATION}")
        for attempt in range(3):
            current, revision, floor, floor_revision = await self.store.nodes.get_with_floor(reg.engine_id)
            previous = current.record.generation if current else 0
            # An engine id without a record (new, or its record was collected) starts above
            # every collected generation: none of their retentions can match it.
            generation = reg.generation or (previous + 1 if current else floor + 1)
            if current is not None and current.record.removed_at:
                # Deregistered: whatever it says, what comes back is a new generation.
                generation = max(generation, previous + 1)
            elif not reg.generation and reg.no_restart_seen and _same_process(current, reg.engine_started_at):
                generation = previous  # its sidecar restarted, not the engine: its blocks are good
            if generation < previous:
                raise FailedPrecondition(
                    f"generation {generation} of {reg.engine_id} is older than the registered {previous}"
                )
            rec = NodeRecord(
                engine_id=reg.engine_id,
                role=Role(reg.role),
                model=reg.model,
                block_size=reg.block_size,
                http_url=reg.http_url,
                side_channel_host=reg.side_channel_host,
                side_channel_port=reg.side_channel_port,
                generation=generation,
                registered_at=self._clock(),
                liveness_ttl=ttl,
                engine_url=reg.engine_url,
                engine_started_at=reg.engine_started_at,
            )
            try:
                stored, stored_revision = await self.store.nodes.put(
                    rec,
                    revision,
                    None if current else floor_revision,
                    previous_lease=current.record.lease_id if current is not None else 0,
                )
            except Conflict:
                if attempt == 2:
                    raise
                continue
            restarted = current is not None and generation != previous
            self.nodes.put(NodeState(stored, True), stored_revision)
            metrics.NODE_REGISTRATIONS.labels("restarted" if restarted else "ok").inc()
            log.info("node.registered", engine_id=reg.engine_id, generation=generation, restarted=restarted)
            return stored, restarted
        raise AssertionError("unreachable")

    async def attach(self, engine_id: str, generation: int, stream: object) -> NodeRecord:
        """Check that a sidecar attaching speaks for the registered generation; `stream`
        (any object, one per Attach stream) is now the one the node's index follows."""
        _check_id("hello.engine_id", engine_id, self._limits.max_id_bytes)
        state, _ = await self.store.nodes.get(engine_id)
        if state is None or state.record.removed_at:
            raise NotFound(f"node {engine_id} is not registered")
        if state.record.suspended_at:
            raise FailedPrecondition(
                f"node {engine_id} is suspended (its last Attach stream ended): register it"
            )
        if generation != state.record.generation:
            raise FailedPrecondition(
                f"node {engine_id} is registered at generation {state.record.generation}, not {generation}"
            )
        if self._streams.get(engine_id) is not stream:
            # What the previous stream indexed is its sidecar's view: the new one starts
            # from its own reset (or sends no KV events at all).
            self.index.drop(engine_id)
            self._reports.pop(engine_id, None)
        self._streams[engine_id] = stream
        return state.record

    async def heartbeat(self, rec: NodeRecord) -> tuple[int, NodeRecord]:
        """Keep a node alive. -> (seconds of liveness left, the record to heartbeat next)."""
        ttl, rec = await self.store.nodes.keepalive(rec)
        if ttl <= 0:
            raise FailedPrecondition(f"node {rec.engine_id} was re-registered or removed; register again")
        return ttl, rec

    def index_events(self, rec: NodeRecord, update: IndexUpdate, stream: object) -> None:
        """Fold one KV-event batch of an attached node into the block index (a stream the
        node re-attached past sends none: its deltas would spoil the newer one's snapshot)."""
        if self._streams.get(rec.engine_id) is not stream:
            return
        if not self.index.apply(rec.engine_id, update):
            log.warning("index.overflow", engine_id=rec.engine_id, max_blocks=MAX_BLOCKS_PER_NODE)
        metrics.INDEXED_HASHES.inc(len(update.stored) + len(update.removed))

    def report(self, rec: NodeRecord, uncaptured_turns: int, unretained_blocks: int, stream: object) -> None:
        """Keep what a heartbeat of an attached node's sidecar counted (in memory)."""
        if self._streams.get(rec.engine_id) is stream:
            self._reports[rec.engine_id] = AttachedCounts(0, uncaptured_turns, unretained_blocks)

    def attached_counts(self, engine_id: str) -> AttachedCounts:
        """What this replica knows of the node from its sidecar."""
        counts = self._reports.get(engine_id, AttachedCounts())
        return replace(counts, indexed_blocks=self.index.count(engine_id))

    def detach(self, rec: NodeRecord, stream: object) -> None:
        """An Attach stream ended: if the node's index followed it, the index would go stale,
        so drop it (a sidecar that re-attached meanwhile keeps the newer stream's)."""
        if self._streams.get(rec.engine_id) is stream:
            del self._streams[rec.engine_id]
            self.index.drop(rec.engine_id)
            self._reports.pop(rec.engine_id, None)
        if not self.stopping:
            task = asyncio.get_running_loop().create_task(self._suspend(rec), name="suspend-node")
            self._putting_back.add(task)
            task.add_done_callback(self._putting_back.discard)

    async def _suspend(self, rec: NodeRecord) -> None:
        """Suspend the node an Attach stream spoke for, now that it ended: nobody vouches for
        its engine process until a sidecar registers it again (see NodeRecord.suspended_at;
        a stream a newer registration replaced suspends nothing). Not while this replica
        stops: its sidecars re-register elsewhere. Failing, the liveness lapses at its TTL."""
        try:
            suspended = await self.store.nodes.suspend(rec, self._clock())
        except StoreUnavailable as e:
            log.warning("node.suspend.failed", engine_id=rec.engine_id, error=str(e))
            return
        if suspended is not None:
            held, revision = suspended
            self.nodes.put(NodeState(held, False), revision)
            metrics.NODE_REGISTRATIONS.labels("suspended").inc()
            log.info("node.suspended", engine_id=rec.engine_id, generation=rec.generation)

    async def score(self, hashes: list[int], role: int) -> list[tuple[str, int]]:
        """Alive nodes (of `role`, 0 = any) by how many leading prompt blocks they cache."""
        if len(hashes) > self._limits.max_tokens:
            raise InvalidArgument(
                f"block_hashes has {len(hashes)} entries, at most {self._limits.max_tokens}"
            )
        states = self.nodes.snapshot()
        engines = [
            e
            for e, s in states.items()
            if s.alive and (not role or s.record.role == role or s.record.role == Role.BOTH)
        ]
        return self.index.score(engines, hashes)

    async def list_nodes(self, role: int, include_dead: bool, fresh: bool = True) -> list[NodeState]:
        """The nodes, read from etcd (`fresh`) or as this replica last saw them."""
        states = await self.nodes.refresh() if fresh else self.nodes.snapshot()
        return sorted(
            (
                s
                for s in states.values()
                if not s.record.removed_at
                and (include_dead or s.alive)
                and (not role or s.record.role == role)
            ),
            key=lambda s: s.record.engine_id,
        )

    async def collect_dead_nodes(self) -> int:
        """Delete the records of nodes dead for `nodes.gc_after_s`: deregistered that long
        ago, or seen without liveness by this replica for that long. -> how many."""
        after = self.settings.nodes.gc_after_s
        wall, mono = self._clock(), time.monotonic()
        collected = 0
        for engine, state in self.nodes.snapshot().items():
            rec = state.record
            if state.alive:
                continue
            dead_s = (
                wall - rec.removed_at if rec.removed_at else mono - self.nodes.dead_since.get(engine, mono)
            )
            revision = self.nodes.revisions.get(engine)
            if dead_s < after or revision is None:
                continue
            if await self.store.nodes.collect(engine, revision, rec.generation):
                self.nodes.drop(engine)
                self.index.drop(engine)
                collected += 1
                metrics.NODES_COLLECTED.inc()
                log.info("node.collected", engine_id=engine, generation=rec.generation, dead_s=round(dead_s))
        return collected

    async def run_node_gc(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.collect_dead_nodes()
            except StoreUnavailable as e:
                log.warning("nodes.collect.failed", error=str(e))
            except Exception:  # a defect: logged, and the next pass runs all the same
                log.exception("nodes.collect.error")

    async def deregister_node(self, engine_id: str) -> bool:
        _check_id("engine_id", engine_id, self._limits.max_id_bytes)
        found = await self.store.nodes.delete(engine_id, self._clock())
        # The tombstone as stored, at its revision: a refresh that read the node alive just
        # before the delete cannot then bring it back (the newer revision stays).
        try:
            await self.nodes.get(engine_id, fresh=True)
        except StoreUnavailable:
            self.nodes.drop(engine_id)
        log.info("node.deregistered", engine_id=engine_id, found=found)
        return found

    # -- leases ---------------------------------------------------------------

    def _tenant(self, tenant: str) -> str:
        _check_id("tenant", tenant, self._limits.max_id_bytes, required=False)
        return tenant or DEFAULT_TENANT

    async def register_lease(self, reg: LeaseRegistration) -> tuple[LeaseView, bool, bytes | None]:
        """-> (the stored lease, whether it replaced one, the params of the replaced one when
        its blocks are still held: no turn claimed it, so nothing else will free them)."""
        lim = self._limits
        tenant = self._tenant(reg.tenant)
        _check_id("conversation_id", reg.conversation_id, lim.max_id_bytes)
        _check_id("engine_id", reg.engine_id, lim.max_id_bytes)
        _check_id("request_id", reg.request_id, lim.max_id_bytes, required=False)
        if not 0 < reg.num_tokens <= lim.max_tokens:
            raise InvalidArgument(f"num_tokens {reg.num_tokens} must be in 1..{lim.max_tokens}")
        if len(reg.params_blob) > lim.max_params_bytes:
            raise InvalidArgument(f"kv_transfer_params are larger than {lim.max_params_bytes} bytes")
        now = self._clock()
        policy = self.settings.policy
        expires_at = reg.expires_at if reg.expires_at is not None else now + policy.default_lifetime_s
        if expires_at <= now:
            raise InvalidArgument(f"expires_at is {now - expires_at:.1f}s in the past")
        if expires_at > now + policy.max_lifetime_s:
            raise InvalidArgument(f"expires_at is more than {policy.max_lifetime_s:g}s ahead")
        node = await self.nodes.get(reg.engine_id)  # (a node it lacks, it has just read)
        if node is not None and (node.record.removed_at or reg.generation not in (0, node.record.generation)):
            # The cache may be a moment behind another replica's registration: look again.
            node = await self.nodes.get(reg.engine_id, fresh=True)
        if node is None or node.record.removed_at:
            raise FailedPrecondition(f"engine {reg.engine_id} is not a registered node")
        if node.record.role == Role.PREFILL:
            raise FailedPrecondition(
                f"engine {reg.engine_id} is a prefill node; retentions live on decode nodes"
            )
        block_size = reg.block_size or node.record.block_size
        if block_size != node.record.block_size:
            raise InvalidArgument(f"block_size {block_size} differs from node's {node.record.block_size}")
        problem = digest_problem("block_digests", reg.digests, reg.num_tokens // block_size)
        if problem:
            raise InvalidArgument(problem)
        problems = param_problems(reg.params, reg.num_tokens, block_size)
        if problems:
            raise InvalidArgument("; ".join(problems))
        generation = reg.generation or node.record.generation
        if generation != node.record.generation:
            raise FailedPrecondition(
                f"blocks are from generation {generation} of {reg.engine_id}, "
                f"which is now at {node.record.generation}"
            )
        retention = Retention(
            engine_id=reg.engine_id,
            generation=generation,
            params=reg.params_blob,
            num_tokens=reg.num_tokens,
            block_size=block_size,
            created_at=now,
            expires_at=expires_at,
            digests=reg.digests,
            request_id=reg.request_id,
            whole_only=holds_null_blocks(reg.params),
        )
        revision, replaced = await self.store.retentions.put(tenant, reg.conversation_id, retention, now)
        metrics.REGISTRATIONS.labels("replaced" if replaced else "new").inc()
        release = None
        if replaced is not None:
            try:
                release = await self._still_held(replaced, retention, now)
            except StoreUnavailable as e:  # (the registration is stored: answer it all the same)
                log.info("lease.replaced.unchecked", conversation_id=reg.conversation_id, error=str(e))
        log.debug(
            "retention.registered", tenant=tenant, conversation_id=reg.conversation_id, tokens=reg.num_tokens
        )
        return LeaseView(tenant, reg.conversation_id, retention, revision), replaced is not None, release

    async def _still_held(self, replaced: Retention, new: Retention, now: float) -> bytes | None:
        """The params of a replaced retention whose blocks D still holds (None: expired, its
        engine restarted or gone, or the same D request registered again)."""
        if replaced.expires_at <= now or replaced.params == new.params:
            return None
        node = await self.nodes.get(replaced.engine_id)
        if node is None or not node.alive or node.record.generation != replaced.generation:
            return None
        same_engine = replaced.engine_id == new.engine_id
        if same_engine and remote_request_of(replaced.params) == remote_request_of(new.params):
            return None
        return replaced.params

    async def lookup(self, q: LookupQuery, later: Awaitable[Prompt] | None = None) -> LookupResult:
        """Claim the conversation's retention (unless `q.peek`) and decide on the prompt.

        With `later`, the prompt is still being computed by the caller: the claim's
        etcd round trip runs while it is awaited (at most PROMPT_WAIT_S; a prompt that
        never comes is an empty one, and the claimed retention is released).
        """
        tenant = self._tenant(q.tenant)
        _check_id("conversation_id", q.conversation_id, self._limits.max_id_bytes)
        if later is not None and q.peek:
            raise InvalidArgument("prompt_follows is for claiming lookups, not peek")
        if later is None:
            self._check_prompt(q.prompt_tokens, q.prompt_digests)
        now = claimed_at = self._clock()
        prompt = Prompt(q.prompt_tokens, q.prompt_digests)
        missing = ""  # why a prompt_follows lookup has no usable prompt
        retention: Retention | None = None
        own = False  # the retention claimed was this request's own, and is back
        # A claim sent before its prompt runs in a task of its own (`claiming`); a plain one
        # is awaited here (`got`, once it returned): no task per lookup on the hot path.
        claiming: asyncio.Future[_Claimed] | None = None
        got: _Claimed | None = None
        try:
            if q.peek:
                stored, claim = await self.store.retentions.read(tenant, q.conversation_id)
                retention = stored.retention if stored else None
            else:
                if later is None:
                    got = await self._claim(tenant, q.conversation_id, q.request_id, now)
                    now = self._clock()  # decide on the time it is now (the claim may have been slow)
                else:
                    claiming = asyncio.ensure_future(
                        self._claim(tenant, q.conversation_id, q.request_id, now)
                    )
                    self._claiming.add(claiming)
                    claiming.add_done_callback(self._claiming.discard)
                    got, prompt, missing = await self._claim_awaiting(claiming, later, q.conversation_id)
                    now = self._clock()  # decide on the time it is now
                outcome, own = got
                retention, claim = outcome.taken, outcome.earlier
            decision = _OWN_TURN if own else await self._decide(retention, claim, prompt, now)
            if missing and retention is not None:
                # Nothing to verify a pull against: RECOMPUTE, releasing what was claimed.
                decision = replace(decision, reason=Reason.NO_PROMPT, detail=missing)
        except StoreUnavailable as e:
            log.warning("lookup.store_unavailable", error=str(e))
            if q.peek:
                retention = None
            # Claimed before etcd failed (reading the node, say): it is spent either way, so
            # hand out its release; a D that restarted meanwhile ignores the notification.
            release = RELEASE if retention is not None and now < retention.expires_at else None
            engine = retention.engine_id if retention is not None else ""
            decision = Decision(False, Reason.STORE_UNAVAILABLE, str(e), release=release, engine_id=engine)
        except asyncio.CancelledError:
            # The caller went away (its deadline, its stream): no answer reaches anyone, so what
            # the claim took goes back, for the next turn: a claim in its own task once it is
            # done, a plain one if it returned (one cancelled in flight may be spent).
            if got is not None:
                self._put_back(got, tenant, q.conversation_id)
            elif claiming is not None:
                claiming.add_done_callback(
                    functools.partial(self._put_back_when_done, tenant, q.conversation_id)
                )
            raise
        claimed = retention is not None and not q.peek
        if claimed and decision.reason is Reason.EXPIRED and got is not None:
            await self._note_deadline(tenant, q.conversation_id, got[0], claimed_at)
        metrics.lookup(decision.pull, decision.reason.value)
        if claimed:
            metrics.claim("pull" if decision.pull else "release" if decision.release else "dead")
            metrics.REUSABLE_TOKENS.inc(decision.reusable_tokens)
        log.debug(
            "retention.lookup",
            tenant=tenant,
            conversation_id=q.conversation_id,
            reason=decision.reason.value,
            claimed=claimed,
        )
        return LookupResult(decision, claimed, retention.params if retention else b"")

    async def _note_deadline(
        self, tenant: str, conversation_id: str, outcome: ClaimOutcome, claimed_at: float
    ) -> None:
        """The claim took a retention expired or about to: its deadline goes into the marker,
        so that the lookups meeting the marker past it answer expired (`decide_claimed`),
        not already_claimed. (Only then: doing it for every claim would double each turn's
        etcd writes. One write failing leaves the marker as it was.)"""
        assert outcome.taken is not None
        claim = Claim(claimed_at=claimed_at, expires_at=outcome.taken.expires_at)
        try:
            await self.store.retentions.note_claim_deadline(
                tenant, conversation_id, outcome.marker_revision, claim
            )
        except StoreUnavailable as e:
            log.warning("lookup.claim_deadline.failed", conversation_id=conversation_id, error=str(e))

    def _check_prompt(self, tokens: int, digests: bytes | None) -> None:
        if not 0 <= tokens <= self._limits.max_tokens:
            raise InvalidArgument(f"prompt_tokens {tokens} must be in 0..{self._limits.max_tokens}")
        problem = digest_problem("prompt_digests", digests or b"")
        if problem:
            raise InvalidArgument(problem)

    async def _claim(self, tenant: str, conversation_id: str, request_id: str, now: float) -> _Claimed:
        """Claim the conversation's retention. -> (what the claim found, whether that was
        the asking request's own retention, taken and put straight back).

        A lookup can reach the daemon after the turn it is for went on without it (it came
        late) and registered: that retention is the next turn's to pull, not this one's."""
        outcome = await self.store.retentions.claim(tenant, conversation_id, now)
        taken = outcome.taken
        if taken is None or not request_id or taken.request_id != request_id:
            return outcome, False
        try:
            back = await self.store.retentions.unclaim(
                tenant, conversation_id, taken, outcome.marker_revision, now
            )
        except StoreUnavailable as e:
            # It may be back all the same (the answer lost, not the write): a release now
            # would free blocks the next turn may be handed. At worst D keeps them to its TTL.
            log.warning("lookup.own_turn.unknown", conversation_id=conversation_id, error=str(e))
            return ClaimOutcome(None), True
        if not back:  # replaced meanwhile, past its deadline, or revoked: this one is spent
            return outcome, False
        log.info("lookup.own_turn", conversation_id=conversation_id, request_id=request_id)
        return ClaimOutcome(None), True

    async def _claim_awaiting(
        self, claiming: asyncio.Future[_Claimed], later: Awaitable[Prompt], conversation_id: str
    ) -> tuple[_Claimed, Prompt, str]:
        """`claiming`, run while the caller's prompt is awaited. -> (its result, the prompt,
        why there is no usable prompt or ""). (Cancelled, it leaves `claiming` running.)"""
        prompt, missing = await self._late_prompt(later, conversation_id)
        return await asyncio.shield(claiming), prompt, missing

    def _put_back_when_done(self, tenant: str, conversation_id: str, done: asyncio.Future[_Claimed]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._put_back(done.result(), tenant, conversation_id)

    def _put_back(self, claimed: _Claimed, tenant: str, conversation_id: str) -> None:
        """Put what a claim took back, in the background (its caller went away)."""
        outcome, own = claimed
        if own or outcome.taken is None:
            return
        taken, marker = outcome.taken, outcome.marker_revision

        async def put_back() -> None:
            try:
                back = await self.store.retentions.unclaim(
                    tenant, conversation_id, taken, marker, self._clock()
                )
            except StoreUnavailable as e:  # spent, then: D frees the blocks at its TTL
                log.warning("lookup.put_back.failed", conversation_id=conversation_id, error=str(e))
                return
            log.info("lookup.put_back", conversation_id=conversation_id, back=back)

        task = asyncio.get_running_loop().create_task(put_back(), name="put-back")
        self._putting_back.add(task)
        task.add_done_callback(self._putting_back.discard)

    async def settle(self) -> None:
        """Until the claims of callers that went away are put back (a stop waits for them)."""
        # (a claim still at etcd when its caller went away makes its put-back once done)
        while self._claiming or self._putting_back:
            await asyncio.gather(*self._claiming, *self._putting_back, return_exceptions=True)

    async def _late_prompt(self, later: Awaitable[Prompt], conversation_id: str) -> tuple[Prompt, str]:
        """The prompt of a prompt_follows lookup -> (prompt, "") or (an empty prompt, why
        there is no usable one). The retention is claimed either way; an empty prompt
        never pulls, and the answer releases D's blocks."""
        try:
            async with asyncio.timeout(PROMPT_WAIT_S):
                prompt = await later
        except TimeoutError:
            log.info("lookup.prompt_missing", conversation_id=conversation_id, waited_s=PROMPT_WAIT_S)
            return Prompt(0), f"no prompt within {PROMPT_WAIT_S:g}s"
        try:
            self._check_prompt(prompt.tokens, prompt.digests)
        except InvalidArgument as e:
            log.warning("lookup.prompt_invalid", conversation_id=conversation_id, error=str(e))
            return Prompt(0), f"invalid prompt: {e}"
        if not prompt.tokens:
            return prompt, "the caller could not make the prompt"
        return prompt, ""

    async def _decide(
        self, retention: Retention | None, claim: Claim | None, prompt: Prompt, now: float
    ) -> Decision:
        policy = self.settings.policy
        if retention is None:
            if claim is not None:
                return decide_claimed(claim, now)
            return decide(None, None, prompt, policy, now)
        node = await self.nodes.get(retention.engine_id)
        decision = decide(retention, node, prompt, policy, now)
        if decision.pull or decision.reason in (Reason.NODE_GONE, Reason.NODE_RESTARTED):
            # The cached view may be a moment old: confirm before giving up the reuse, and
            # before a pull, which must not reach a node suspended or registered anew since
            # (another process behind the same engine id: see sidecar/identity.py).
            node = await self.nodes.get(retention.engine_id, fresh=True)
            decision = decide(retention, node, prompt, policy, now)
        return decision

    async def get_lease(self, tenant: str, conversation_id: str) -> LeaseView:
        tenant = self._tenant(tenant)
        _check_id("conversation_id", conversation_id, self._limits.max_id_bytes)
        stored, claim = await self.store.retentions.read(tenant, conversation_id)
        if stored is None and claim is None:
            raise NotFound(f"no lease for conversation {conversation_id!r} of tenant {tenant!r}")
        if stored is not None:
            return LeaseView(tenant, conversation_id, stored.retention, stored.revision)
        return LeaseView(tenant, conversation_id, None, claim=claim)

    async def list_leases(
        self,
        tenant: str,
        all_tenants: bool,
        engine_id: str,
        include_inactive: bool,
        page_size: int,
        page_token: str,
    ) -> tuple[list[LeaseView], str]:
        if page_size < 0 or page_size > MAX_PAGE:
            raise InvalidArgument(f"page_size {page_size} must be in 0..{MAX_PAGE}")
        _check_id("engine_id", engine_id, self._limits.max_id_bytes, required=False)
        page_size = page_size or 100
        keys = self.store.keys
        prefix = keys.retentions if all_tenants else keys.tenant_retentions(self._tenant(tenant))
        start = b""
        if page_token:
            try:
                start = base64.urlsafe_b64decode(page_token.encode())
            except (binascii.Error, ValueError) as e:
                raise InvalidArgument("page_token is not a token this daemon issued") from e
            if not start.startswith(prefix):
                raise InvalidArgument("page_token belongs to another listing")
        now = self._clock()
        out: list[LeaseView] = []
        size = 0  # about the page's encoded bytes: it must fit a client's message limit
        full = False
        examined = 0
        while len(out) < page_size and not full and examined < LIST_EXAMINED:
            want = min(page_size - len(out), LIST_EXAMINED - examined)
            batch, start = await self.store.scans.page(prefix, start, want)
            examined += len(batch)
            for s in batch:
                r = s.retention
                if (engine_id and r.engine_id != engine_id) or not (include_inactive or r.expires_at > now):
                    continue
                size += len(r.params) + len(r.digests) + _LEASE_OVERHEAD
                if out and size > MESSAGE_BUDGET:  # this lease and the rest: the next page
                    start, full = keys.retention(s.tenant, s.conversation_id), True
                    break
                out.append(LeaseView(s.tenant, s.conversation_id, r, s.revision))
            if not start:
                break
        return out, base64.urlsafe_b64encode(start).decode() if start else ""

    async def revoke_lease(self, tenant: str, conversation_id: str) -> tuple[LeaseView | None, bool]:
        """Delete the conversation's retention. -> (what was revoked, None if nothing was;
        whether its blocks are still D's to free: what a lookup that reuses nothing would
        release, i.e. not expired, its node alive at the retention's generation)."""
        tenant = self._tenant(tenant)
        _check_id("conversation_id", conversation_id, self._limits.max_id_bytes)
        stored = await self.store.retentions.revoke(tenant, conversation_id)
        log.info(
            "retention.revoked", tenant=tenant, conversation_id=conversation_id, found=stored is not None
        )
        if stored is None:
            return None, False
        retention, now = stored.retention, self._clock()
        view = LeaseView(tenant, conversation_id, retention, stored.revision)
        try:
            decision = await self._decide(retention, None, Prompt(0), now)
        except StoreUnavailable as e:
            # As a lookup's claim when etcd fails after it: hand out the release while the
            # deadline holds; a D that restarted meanwhile ignores the notification.
            log.warning("retention.revoked.node_unknown", conversation_id=conversation_id, error=str(e))
            return view, now < retention.expires_at
        return view, decision.release is not None

    async def scan_gauges(self) -> None:
        """Set the live-lease and held-token gauges per node from one pass over etcd."""
        now = self._clock()
        leases: dict[str, int] = {}
        tokens: dict[str, int] = {}
        # A background pass at ~2,000 records/s, 100 at a time: a large store never holds
        # lookups up for more than a page's decoding (~1 ms), and the pass costs etcd
        # little (at 5,000/s it moved Lookup p99 at 1,000/s from ~9 to ~17 ms here).
        async for r in self.store.scans.scan_held(pause_s=0.05):
            if r.expires_at > now:
                leases[r.engine_id] = leases.get(r.engine_id, 0) + 1
                tokens[r.engine_id] = tokens.get(r.engine_id, 0) + r.num_tokens
        metrics.LIVE_LEASES.clear()
        metrics.HELD_TOKENS.clear()
        for engine, n in leases.items():
            metrics.LIVE_LEASES.labels(engine).set(n)
            metrics.HELD_TOKENS.labels(engine).set(tokens[engine])
        self.held = {e: (leases[e], tokens[e]) for e in leases}

    async def run_gauges(self, interval_s: float) -> None:
        """Rescan every `interval_s`, or every 10 scan-durations when the store is large,
        so the scan (paced at ~2,000 records/s) runs at most ~10% of the time: at 100,000
        retentions the gauges are up to ~10 minutes old."""
        while True:
            start = time.monotonic()
            try:
                await self.scan_gauges()
            except StoreUnavailable as e:
                log.warning("gauges.scan.failed", error=str(e))
            except Exception:  # a defect: logged, and the next scan runs all the same
                log.exception("gauges.scan.error")
            took = time.monotonic() - start
            await asyncio.sleep(max(interval_s, 10 * took) - took)

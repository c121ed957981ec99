"""Retention registrations: a bounded queue, and its sender over one Leases/Stream.

The tap hands finished turns to `RetentionSender.submit` and returns at once; the
sender registers them in the background, several in flight on one
``Leases/Stream`` (``kvferry.leaseclient.LeaseStream``). While the daemon is
unreachable registrations wait in a capped queue: beyond `queue_size` the
oldest is dropped, entries past their deadline or from an engine process that
has since restarted are dropped, and a registration is tried at most
`max_attempts` times; one the daemon turned away undecided because etcd or the
conversation's owner could not take it (ABORTED, "not applied") waits as an unsent one
does. One that reached the daemon without a clear answer (which
etcd may have stored) is never sent again; one whose status proves it stored
nowhere, for good (refused) or after its last try, has D free its blocks
(`retry_decision`). A conversation's
draft that a newer turn's draft overtook while it waited (or failed) is not sent:
registered, it would replace the newer retention; D is told to free its blocks
instead. Every drop is counted, and what it leaves pinned on D goes to the orphan book
(``sidecar.orphans``): released through a P when no retention can name it, else
counted until D's TTL; a periodic pass releases those waiting for room in the releaser.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import replace
from typing import Any

import grpc
import structlog

from kvferry.leaseclient import LeaseOpError, LeaseStream
from kvferry.releases import notifiable
from kvferry.structs import dict_to_struct, struct_to_dict
from kvferry.v1 import leases_pb2
from sidecar.daemon import TRANSIENT, Backoff, DaemonLink
from sidecar.drafts import RetentionDraft, digests_of
from sidecar.engine import EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.orphanrelease import OrphanReleases
from sidecar.releases import Releaser
from sidecar.settings import Settings
from sidecar.unretained import UnretainedLedger

log = structlog.get_logger(__name__)


class RegistrationQueue:
    """Drafts waiting to be sent, oldest first, at most `capacity`. Pure.

    It numbers the drafts pushed and remembers each conversation's newest while any of
    its drafts is queued or in flight (not yet `done`): an older one is "superseded".
    A conversation's draft waits while another of its drafts is in flight (`pop` to
    `landed`): the daemon stores whichever registration lands last, so two turns'
    registrations sent together could leave the older turn's retention in place."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[RetentionDraft] = deque()
        self._pushed = 0
        self._newest: dict[tuple[str, str], int] = {}
        self._outstanding: dict[tuple[str, str], int] = {}
        self._flying: set[tuple[str, str]] = set()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, draft: RetentionDraft) -> RetentionDraft | None:
        """Add a new draft; -> the oldest one, dropped to make room."""
        self._pushed += 1
        draft = replace(draft, seq=self._pushed)
        key = _key(draft)
        self._newest[key] = draft.seq
        self._outstanding[key] = self._outstanding.get(key, 0) + 1
        self._items.append(draft)
        return self._items.popleft() if len(self._items) > self.capacity else None

    def retry(self, draft: RetentionDraft, now_wall: float, epoch: int) -> tuple[RetentionDraft, str] | None:
        """Put a failed draft back in front; -> one dropped instead, and why: the draft
        itself when a newer one of its conversation came meanwhile, else the newest
        one when there is no room."""
        reason = self._dead(draft, now_wall, epoch)
        if reason is not None:
            return draft, reason
        self._items.appendleft(draft)
        return (self._items.pop(), "overflow") if len(self._items) > self.capacity else None

    def pop(
        self, now_wall: float, epoch: int
    ) -> tuple[RetentionDraft | None, list[tuple[RetentionDraft, str]]]:
        """The oldest draft worth sending whose conversation has none in flight (it is in
        flight from now until `landed`), and the dead ones taken out on the way (with why)."""
        dead: list[tuple[RetentionDraft, str]] = []
        waiting: list[RetentionDraft] = []
        found = None
        while self._items:
            draft = self._items.popleft()
            reason = self._dead(draft, now_wall, epoch)
            if reason is not None:
                dead.append((draft, reason))
            elif _key(draft) in self._flying:
                waiting.append(draft)
            else:
                found = draft
                self._flying.add(_key(draft))
                break
        self._items.extendleft(reversed(waiting))
        return found, dead

    def take_all(self) -> list[RetentionDraft]:
        """Every draft queued, taken out (none is sent any more)."""
        taken = list(self._items)
        self._items.clear()
        return taken

    def landed(self, draft: RetentionDraft) -> None:
        """The try of a draft `pop` gave ended (however): its conversation's next may go."""
        self._flying.discard(_key(draft))

    def _dead(self, draft: RetentionDraft, now_wall: float, epoch: int) -> str | None:
        """Why not to send the draft (None: send it). Expired or of an earlier engine
        process before superseded: D no longer holds those blocks, nothing to free."""
        reason = dead_reason(draft, now_wall, epoch)
        if reason is None and self.superseded(draft):
            return "superseded"
        return reason

    def superseded(self, draft: RetentionDraft) -> bool:
        """Whether a newer draft of the draft's conversation was pushed after it."""
        return draft.seq < self._newest.get(_key(draft), 0)

    def done(self, draft: RetentionDraft) -> None:
        """The draft left for good (registered, or dropped); a conversation with none left
        queued or in flight is forgotten."""
        key = _key(draft)
        left = self._outstanding.get(key, 0) - 1
        if left > 0:
            self._outstanding[key] = left
        else:
            self._outstanding.pop(key, None)
            self._newest.pop(key, None)


def _key(draft: RetentionDraft) -> tuple[str, str]:
    return draft.tenant, draft.conversation_id


def dead_reason(draft: RetentionDraft, now_wall: float, epoch: int) -> str | None:
    """Why a draft is no longer worth registering (None: it is)."""
    if draft.epoch != epoch:
        return "restarted"
    if draft.expires_at <= now_wall:
        return "expired"
    return None


#: No answer: the daemon was not reached, or could not reach etcd, or the answer was lost.
NOT_ANSWERED = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
#: The daemon (or the gRPC layer in front of it) turned the registration, or its whole
#: stream, away before writing anything, and would again: stored nowhere, ever.
REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
#: Turned away before writing, for a passing reason (the node re-registering, an
#: overloaded daemon): worth another try.
NOT_WRITTEN = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED})
#: Turned away undecided because etcd, or the daemon replica owning the conversation,
#: could not take it now (the daemon's NotApplied; a transaction that lost a race):
#: nothing stored, so it waits for them as an unanswered try does.
NOT_APPLIED = frozenset({grpc.StatusCode.ABORTED})


def retry_decision(code: grpc.StatusCode, attempts: int, max_attempts: int, *, sent: bool) -> str:
    """After a failed try, what to do with the draft, from what its status proves about the
    write (`sent`: the try reached the daemon's stream; `code`: the op's error, or the
    status its stream ended with).

    "failed": refused for good (`REFUSED`), whether sent or not: nothing was stored, and
    D is told to free its blocks. "maybe_stored": the try reached the daemon and failed in
    a way that leaves open whether etcd stored it (a timeout, a lost answer, etcd slow, a
    daemon's defect: any code not known to prove the contrary). It is not sent again: by
    the time a resend lands, the retention may have been handed out and D's blocks freed,
    and storing it again would hand them to a second P (wrong KV, silently). The next turn
    of the conversation recomputes at worst. "requeue": it never reached the daemon: wait
    for it, bounded by the queue's capacity and the draft's deadline, not by attempts.
    "retry": turned away unwritten for a passing reason (`NOT_WRITTEN`, or a local failure
    before it left); "attempts": tried enough (nothing stored either). A try the daemon
    turned away undecided while etcd or the conversation's owner could not take it
    (`NOT_APPLIED`) is requeued as well: a stall of etcd (a busy machine, a slow disk)
    outlasts a few quick tries, and the turn's reuse would be lost for nothing.
    """
    if code in REFUSED:
        return "failed"
    if code in NOT_APPLIED:
        return "requeue"
    if sent and code not in NOT_WRITTEN:
        return "maybe_stored"
    if code in NOT_ANSWERED:
        return "requeue"
    return "retry" if attempts < max_attempts else "attempts"


class RetentionSender:
    """Sends queued drafts to the daemon, forever, several at a time on one Leases/Stream."""

    def __init__(
        self,
        settings: Settings,
        instance: EngineInstance,
        link: DaemonLink,
        metrics: SidecarMetrics,
        releaser: Releaser | None = None,
        unretained: UnretainedLedger | None = None,
    ) -> None:
        self._s = settings
        self._releaser = releaser
        """Where the replaced retentions' releases the daemon hands back go (None: nowhere)."""
        if unretained is None:  # (a sender of its own: it follows the engine's restarts itself)
            unretained = UnretainedLedger(settings.engine.blocks_ttl_s)
            instance.on_restart(lambda: unretained.restart(instance.epoch))
        self.orphans = OrphanReleases(instance, unretained, metrics, releaser)
        """What the drafts given up on leave pinned on D: released, or counted."""
        self._instance = instance
        self._link = link
        self._metrics = metrics
        self._queue = RegistrationQueue(settings.retentions.queue_size)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        pause_max = min(settings.daemon.backoff_max_s, settings.retentions.retry_pause_max_s)
        self._backoff = Backoff(min(settings.daemon.backoff_initial_s, pause_max), pause_max)
        self._pause_until = 0.0
        instance.watch(self._wakeup.set)

    @property
    def pending(self) -> int:
        """Drafts queued or in flight."""
        return len(self._queue) + len(self._in_flight)

    def abandon(self) -> int:
        """Drop what is still queued (the sidecar stops; counted, not registered); -> how many."""
        left = self._queue.take_all()
        for draft in left:
            self._drop(draft, "shutdown")
        self._changed()
        return len(left)

    def submit(self, draft: RetentionDraft) -> None:
        """Queue a draft (never blocks)."""
        dropped = self._queue.push(draft)
        if dropped is not None:
            self._drop(dropped, "overflow")
        self._changed()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or in flight; -> whether that happened in time.

        True once the sender was idle at some moment, even if new work came in
        right after (checking the flag again after waking would miss that)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def _changed(self) -> None:
        self._metrics.registration_queue.set(len(self._queue))
        if self.pending:
            self._idle.clear()
        else:
            self._idle.set()
        self._wakeup.set()

    def _drop(self, draft: RetentionDraft, reason: str) -> None:
        self._queue.done(draft)
        self._metrics.registrations_dropped.labels(reason).inc()
        log.info("retention.register.dropped", reason=reason, conversation_id=draft.conversation_id)
        self.orphans.dropped(draft, reason)

    def _release(self, params: dict[str, Any], conversation_id: str) -> None:
        """Have D free the blocks `params` (nothing to pull) name, through a prefill node
        (not when they do not name their holder: such params never left the sidecar)."""
        if self._releaser is None or not notifiable(params):
            return
        facts = self._instance.facts
        model, block_size = (facts.model, facts.block_size) if facts is not None else ("", 0)
        self._releaser.release(params, model, block_size, conversation_id)

    def _next(self) -> RetentionDraft | None:
        draft, dead = self._queue.pop(time.time(), self._instance.epoch)
        for d, reason in dead:
            self._drop(d, reason)
        return draft

    def _request(self, draft: RetentionDraft) -> leases_pb2.RegisterLeaseRequest:
        facts = self._instance.facts
        assert facts is not None and self._instance.generation is not None
        req = leases_pb2.RegisterLeaseRequest(
            tenant=draft.tenant,
            conversation_id=draft.conversation_id,
            engine_id=self._s.node_id,
            num_tokens=draft.num_tokens,
            block_size=facts.block_size,
            block_digests=digests_of(draft, facts.model, facts.block_size),
            generation=self._instance.generation,
            request_id=draft.request_id,
        )
        dict_to_struct(draft.params, req.kv_transfer_params)
        req.expires_at.FromNanoseconds(int(draft.expires_at * 1e9))
        return req

    def _failed(self, draft: RetentionDraft, code: grpc.StatusCode, detail: str, *, sent: bool) -> None:
        """A try failed with `code`: put it back and pause, or give up."""
        decision = retry_decision(code, draft.attempts + 1, self._s.retentions.max_attempts, sent=sent)
        if decision in ("requeue", "retry", "maybe_stored"):  # a daemon (or etcd) in trouble
            self._pause_until = asyncio.get_running_loop().time() + self._backoff.next()
        if decision in ("requeue", "retry"):
            if decision == "retry":
                draft = replace(draft, attempts=draft.attempts + 1)
            self._metrics.registrations.labels(decision).inc()
            dropped = self._queue.retry(draft, time.time(), self._instance.epoch)
            if dropped is not None:
                self._drop(*dropped)
        elif decision in ("attempts", "maybe_stored"):
            self._drop(draft, decision)
        else:
            self._queue.done(draft)
            self._metrics.registrations.labels("failed").inc()
            log.warning(
                "retention.register.failed",
                code=code.name,
                detail=detail,
                conversation_id=draft.conversation_id,
            )
            # Refused for good (a policy's limit: a hybrid model's clipped groups, a lifetime
            # past the daemon's...), so stored nowhere: no turn will pull or free D's blocks.
            self.orphans.dropped(draft, "failed")

    # -- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        channel = self._link.channel()
        stream = LeaseStream(channel, opener=self._link.stream_opener())
        reconcile = asyncio.create_task(
            self.orphans.run(self._link, self._s.node_id, self._s.daemon.rpc_timeout_s),
            name="sidecar-orphans",
        )
        try:
            while True:
                await self._ready()
                if self._link.channel() is not channel:  # failed over
                    await stream.close()
                    channel = self._link.channel()
                    stream = LeaseStream(channel, opener=self._link.stream_opener())
                    continue  # (ready again: the engine may have restarted meanwhile)
                draft = self._next()
                if draft is None:  # (the ones queued wait for their conversation's in flight)
                    self._changed()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    req = self._request(draft)  # now, while the generation is surely this epoch's
                except (ValueError, TypeError, ArithmeticError) as e:  # params a Struct cannot hold
                    # (ArithmeticError: an integer beyond a double, which a Struct's numbers are)
                    self._queue.landed(draft)
                    self._failed(draft, grpc.StatusCode.INVALID_ARGUMENT, str(e), sent=False)
                    self._changed()
                    continue
                task = asyncio.create_task(
                    self._send(stream, channel, draft, req), name="sidecar-registration"
                )
                self._in_flight.add(task)
                # (digests of a long sequence take ms: a backlog sent when the daemon is back
                # must not hold up the answers the tap relays)
                await asyncio.sleep(0)
        finally:
            for task in (*self._in_flight, reconcile):
                task.cancel()
            await asyncio.gather(*self._in_flight, reconcile, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stream.close(), 1.0)

    async def _ready(self) -> None:
        """Until a draft may go: something queued, node registered, not paused, room in flight."""
        loop = asyncio.get_running_loop()
        while True:
            pause = self._pause_until - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
                continue
            if (
                self._instance.registered.is_set()
                and len(self._queue)
                and len(self._in_flight) < self._s.retentions.max_in_flight
            ):
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    async def _send(
        self,
        stream: LeaseStream,
        channel: grpc.aio.Channel,
        draft: RetentionDraft,
        req: leases_pb2.RegisterLeaseRequest,
    ) -> None:
        try:
            res = await stream.register(req, self._s.daemon.rpc_timeout_s)
        except asyncio.CancelledError:  # (the sidecar stops): counted, maybe stored
            self._drop(draft, "cancelled")
            raise
        except LeaseOpError as e:
            if e.code in TRANSIENT:
                log.warning("retention.daemon.unavailable", code=e.code.name, address=self._link.address)
            self._failed(draft, e.code, e.message, sent=e.sent)  # (before any await: it is counted)
            if e.stream_lost:
                # Only a lost stream moves to another replica: the channel is shared with the
                # node's Attach stream, and an op's own error or timeout (etcd slow, say) would
                # not be better there.
                await self._link.failover(channel)
        else:
            self._queue.done(draft)
            self._backoff.reset()
            self._metrics.registrations.labels("sent").inc()
            self.orphans.registered(draft)
            if res.HasField("release_params"):  # the retention it replaced
                released = struct_to_dict(res.release_params)
                self._metrics.releases.labels("replaced").inc()
                self._release(released, draft.conversation_id)
                self.orphans.resolved(_key(draft), released)
        finally:
            self._queue.landed(draft)
            task = asyncio.current_task()
            if task is not None:
                self._in_flight.discard(task)
            self._changed()

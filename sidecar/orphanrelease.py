"""The sender's orphan pins put to work: the releases `sidecar.orphans` decides, sent.

A draft the sender gives up on (`dropped`) becomes a pin in the orphan book; one stored
nowhere is released through a prefill node by the sidecar's releaser, as many at a time
as it has room for beside the replaced retentions' releases (`ORPHAN_ROOM`). A release
that does not take is tried again or counted (`OrphanBook.unreleased`), and a periodic
pass (`run`) sends those that waited for room. The gauge
``kvferry_sidecar_orphan_blocks`` reads the book, and the uncaptured turns' ledger.

A registered retention's pin (`registered`) is kept too: from HELD_ASK_AFTER_S on, the
periodic pass asks the daemon what became of it (Leases/Held, `check_held`), and one
whose claim reached nobody (the router crashed, the stream broke after the daemon's
answer) is released like a dropped draft's, reason "unanswered".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import structlog

from kvferry.releases import nothing_to_pull, notifiable
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from sidecar.daemon import DaemonLink
from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.orphans import (
    COUNTED,
    HELD_ASK_AFTER_S,
    HELD_BATCH,
    HELD_CALLS,
    HELD_EVERY_S,
    RELEASED,
    UNANSWERED,
    Held,
    Pin,
    Registered,
    blocks_of,
    request_of,
)
from sidecar.releases import MAX_IN_FLIGHT, Releaser
from sidecar.unretained import STREAM_WITHOUT_PARAMS, UnretainedLedger

log = structlog.get_logger(__name__)

#: How often the orphan book is gone through (releases waiting for room, pins D freed).
RECONCILE_S = 1.0
#: The releases on their way beyond which orphans wait: the rest of the releaser's room
#: stays for the replaced retentions' releases.
ORPHAN_ROOM = MAX_IN_FLIGHT // 2
_STATES: dict[int, Held] = {
    leases_pb2.PIN_RETAINED: "retained",
    leases_pb2.PIN_CLAIMED: "claimed",
    leases_pb2.PIN_SETTLED: "settled",
    leases_pb2.PIN_ORPHAN: "orphan",
}
#: A daemon answering these to Leases/Held will not answer otherwise: asked no more.
_HELD_REFUSED = frozenset(
    {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION}
)


class OrphanReleases:
    """Sends the orphan book's releases through `releaser` (None: every pin is counted)."""

    def __init__(
        self,
        instance: EngineInstance,
        unretained: UnretainedLedger,
        metrics: SidecarMetrics,
        releaser: Releaser | None,
    ) -> None:
        self._instance = instance
        self.unretained = unretained
        """The blocks D pins that no retention names; its orphan book holds the drafts' ones."""
        self._book = unretained.orphans
        self._metrics = metrics
        self._releaser = releaser
        self.ask_after_s = HELD_ASK_AFTER_S
        """How long after its registration a pin is first asked about (Leases/Held)."""
        self.held_every_s = HELD_EVERY_S
        """Seconds between two Leases/Held passes."""
        self._held_off = False  # the daemon refused Leases/Held for good
        for reason in (STREAM_WITHOUT_PARAMS, *sorted(COUNTED | RELEASED)):
            metrics.orphan_blocks.labels(reason).set_function(self._gauge(reason))

    def dropped(self, draft: RetentionDraft, reason: str) -> None:
        """D holds the draft's blocks with no retention naming them (dropped for `reason`):
        into the book, which says whether they are released or only counted."""
        params = nothing_to_pull(draft.params)
        pin = self._pin(draft, params, reason, notifiable(params) and self._releaser is not None)
        decision = self._book.dropped(pin, time.time())
        if decision != "gone":
            self._metrics.orphans.labels(reason, "released" if decision == "release" else "counted").inc()
        if decision == "count" and reason in COUNTED:
            log.info("retention.orphan.counted", reason=reason, conversation_id=draft.conversation_id)
        self.release_waiting()

    def registered(self, draft: RetentionDraft) -> None:
        """The daemon acknowledged the draft's retention: D holds its blocks until a P pulls
        them, its TTL, or a release; kept for Leases/Held (not when nothing could release
        it: no releaser, params that name no holder, no request ids)."""
        params = nothing_to_pull(draft.params)
        if self._releaser is None or self._held_off or not draft.request_id or not request_of(params):
            return
        if not notifiable(params):
            return
        pin = self._pin(draft, params, UNANSWERED)
        self._book.registered.add(Registered(pin, draft.request_id, time.time()))

    def _pin(self, draft: RetentionDraft, params: dict[str, Any], reason: str, notify: bool = True) -> Pin:
        """The blocks `draft` has D hold, as the book keeps them (`params`: made unpullable)."""
        facts = self._instance.facts
        return Pin(
            conversation=(draft.tenant, draft.conversation_id),
            params=params,
            blocks=blocks_of(draft.num_tokens, facts.block_size if facts is not None else 0),
            expires_at=draft.expires_at,
            epoch=draft.epoch,
            reason=reason,
            notifiable=notify,
        )

    async def check_held(
        self, leases: leases_pb2_grpc.LeasesAsyncStub, node_id: str, timeout_s: float
    ) -> int:
        """One Leases/Held call about the registered pins due (`RegisteredPins.due`): those
        whose claim reached nobody are released. -> how many were asked about. (An RPC
        error propagates: grpc.aio.AioRpcError.)"""
        now = time.time()
        due = self._book.registered.due(now, self._book.epoch, HELD_BATCH, self.ask_after_s)
        if not due:
            return 0
        req = leases_pb2.HeldRequest(engine_id=node_id)
        for r in due:
            tenant, conversation = r.pin.conversation
            req.pins.add(
                tenant=tenant,
                conversation_id=conversation,
                request_id=r.request_id,
                remote_request_id=r.remote_request_id,
            )
        res = await leases.Held(req, timeout=timeout_s)
        now = time.time()
        for r, value in zip(due, res.states, strict=False):
            state = _STATES.get(value)
            if state is None:  # (a state this version does not know: asked again later)
                continue
            self._metrics.held_pins.labels(state).inc()
            if self._book.registered.answered(r, state, now, self.held_every_s):
                log.info("retention.orphan.unanswered", conversation_id=r.pin.conversation[1])
                self._book.dropped(r.pin, now)
                self._metrics.orphans.labels(UNANSWERED, "released").inc()
        self.release_waiting()
        return len(due)

    async def _held_pass(
        self, leases: leases_pb2_grpc.LeasesAsyncStub, node_id: str, timeout_s: float
    ) -> None:
        """`check_held`, its errors logged: a daemon that refuses it for good is asked no more
        (the pins then go with D's TTL, as before)."""
        try:
            for _ in range(HELD_CALLS):
                if await self.check_held(leases, node_id, timeout_s) < HELD_BATCH:
                    break
        except grpc.aio.AioRpcError as e:
            if e.code() in _HELD_REFUSED:
                self._held_off = True
                self._book.registered.clear()
                log.warning("retention.held.refused", code=e.code().name, detail=e.details())
            else:
                log.info("retention.held.unanswered", code=e.code().name, detail=e.details())

    def resolved(self, conversation: tuple[str, str], released: Mapping[str, Any]) -> None:
        """A registration of `conversation` handed back `released` (a replaced retention's
        params, which the sender releases): a counted pin of that D request is no more."""
        for pin in self._book.resolved(conversation, released):
            self._metrics.orphans.labels(pin.reason, "resolved").inc()

    def release_waiting(self) -> None:
        """Release the pins waiting, as many as the releaser has room for."""
        if self._releaser is None:
            return
        facts = self._instance.facts
        model, block_size = (facts.model, facts.block_size) if facts is not None else ("", 0)
        for pin in self._book.take(time.time(), ORPHAN_ROOM - self._releaser.in_flight):
            self._metrics.releases.labels(UNANSWERED if pin.reason == UNANSWERED else "orphan").inc()
            self._releaser.release(pin.params, model, block_size, pin.conversation[1], self._done(pin))

    def _done(self, pin: Pin) -> Callable[[str], None]:
        """What to do once a pin's release ended: one that did not take is tried again
        later, or counted until D's TTL."""

        def done(outcome: str) -> None:
            if outcome != "released":
                then = self._book.unreleased(pin, outcome, time.time())
                log.info("retention.orphan.unreleased", outcome=outcome, then=then, reason=pin.reason)

        return done

    def _gauge(self, reason: str) -> Callable[[], float]:
        return lambda: self.unretained.by_reason(time.monotonic()).get(reason, 0)

    async def run(self, link: DaemonLink | None = None, node_id: str = "", timeout_s: float = 10.0) -> None:
        """Forever: release the pins that waited for room (those D freed meanwhile, or of
        an engine process gone, are forgotten on the way), and every `held_every_s` ask
        the daemon `link` leads to about the registered ones (as node `node_id`)."""
        loop = asyncio.get_running_loop()
        next_held = loop.time() + self.held_every_s
        while True:
            await asyncio.sleep(min(RECONCILE_S, self.held_every_s))
            self.release_waiting()
            if link is not None and not self._held_off and loop.time() >= next_held:
                await self._held_pass(link.leases(link.channel()), node_id, timeout_s)
                next_held = loop.time() + self.held_every_s

"""The sender's orphan pins put to work: the releases `sidecar.orphans` decides, sent.

A draft the sender gives up on (`dropped`) becomes a pin in the orphan book; one stored
nowhere is released through a prefill node by the sidecar's releaser, as many at a time
as it has room for beside the replaced retentions' releases (`ORPHAN_ROOM`). A release
that does not take is tried again or counted (`OrphanBook.unreleased`), and a periodic
pass (`run`) sends those that waited for room. The gauge
``kvferry_sidecar_orphan_blocks`` reads the book, and the uncaptured turns' ledger.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from kvferry.releases import nothing_to_pull, notifiable
from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.orphans import COUNTED, RELEASED, Pin, blocks_of
from sidecar.releases import MAX_IN_FLIGHT, Releaser
from sidecar.unretained import STREAM_WITHOUT_PARAMS, UnretainedLedger

log = structlog.get_logger(__name__)

#: How often the orphan book is gone through (releases waiting for room, pins D freed).
RECONCILE_S = 1.0
#: The releases on their way beyond which orphans wait: the rest of the releaser's room
#: stays for the replaced retentions' releases.
ORPHAN_ROOM = MAX_IN_FLIGHT // 2


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
        for reason in (STREAM_WITHOUT_PARAMS, *sorted(COUNTED | RELEASED)):
            metrics.orphan_blocks.labels(reason).set_function(self._gauge(reason))

    def dropped(self, draft: RetentionDraft, reason: str) -> None:
        """D holds the draft's blocks with no retention naming them (dropped for `reason`):
        into the book, which says whether they are released or only counted."""
        facts = self._instance.facts
        params = nothing_to_pull(draft.params)
        pin = Pin(
            conversation=(draft.tenant, draft.conversation_id),
            params=params,
            blocks=blocks_of(draft.num_tokens, facts.block_size if facts is not None else 0),
            expires_at=draft.expires_at,
            epoch=draft.epoch,
            reason=reason,
            notifiable=notifiable(params) and self._releaser is not None,
        )
        decision = self._book.dropped(pin, time.time())
        if decision != "gone":
            self._metrics.orphans.labels(reason, "released" if decision == "release" else "counted").inc()
        if decision == "count" and reason in COUNTED:
            log.info("retention.orphan.counted", reason=reason, conversation_id=draft.conversation_id)
        self.release_waiting()

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
            self._metrics.releases.labels("orphan").inc()
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

    async def run(self) -> None:
        """Forever: release the pins that waited for room (those D freed meanwhile, or of
        an engine process gone, are forgotten on the way)."""
        while True:
            await asyncio.sleep(RECONCILE_S)
            self.release_waiting()

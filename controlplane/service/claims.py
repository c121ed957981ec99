"""Claims on retentions, all in one place: the claim that takes a conversation's retention
for a lookup, the put-back of a lookup's own retention (it came late, after its own turn
registered), the put-back of what was taken for a caller that went away, and the
deadline noted in a marker.

A retention is handed out once: a claim takes it out of its shard owner's memory
(controlplane.owners: decided there, made durable in etcd behind the answer), and only a
claim whose answer reaches nobody puts it back. A put-back the conversation's next
registration (or a revoke) overtook has D's sidecar free the blocks instead.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from controlplane.errors import StoreUnavailable
from controlplane.owners import OwnedRetentions
from controlplane.records import Claim, Retention
from controlplane.service.background import Background
from controlplane.service.budgets import Budgets
from controlplane.store.retentions import ClaimOutcome

log = structlog.get_logger(__name__)
T = TypeVar("T")
StillHeld = Callable[[Retention, Retention | None, float], Awaitable[bytes | None]]
"""(a retention out of etcd, the conversation's retention now, now) -> its params if D
still holds its blocks with nothing else to free them."""

PUT_BACK_PAUSES_S = (0.1, 0.3, 1.0, 2.0)
"""Pauses between the tries of a put-back etcd did not answer (a leader election takes about
a second): then it is given up, and D keeps the blocks to its TTL. A stop waits for them."""


@dataclass(frozen=True)
class Claimed:
    """What a lookup's claim came back with."""

    taken: Retention | None = None
    """The retention the claim took (None: there was none, or it was the lookup's own)."""
    earlier: Claim | None = None
    """The marker of an earlier claim, when that is what the claim found."""
    own: bool = False
    """It was the asking request's own retention, taken and put straight back."""
    marker_revision: int = 0
    """The revision of the marker the claim left (0: it took nothing)."""


class Claims:
    """Claims of this replica's lookups on the conversations' retentions."""

    def __init__(
        self,
        store: OwnedRetentions,
        background: Background,
        clock: Callable[[], float],
        budgets: Budgets,
        still_held: StillHeld,
    ) -> None:
        """`still_held` is `Retentions.still_held`: whether D holds a retention's blocks for
        nobody else; `budgets` has D's sidecar free them."""
        self._store = store
        self._budgets = budgets
        self._still_held = still_held
        self._background = background
        self._clock = clock

    async def claim(
        self, tenant: str, conversation_id: str, request_id: str, now: float, made: ClaimOutcome | None = None
    ) -> Claimed:
        """Claim the conversation's retention for the lookup of request `request_id`
        (`made`: the claim is made already, by `claim_now`).

        A lookup can reach the daemon after the turn it is for went on without it (it came
        late) and registered: that retention is the next turn's to pull, not this one's,
        and goes straight back (`Claimed.own`)."""
        outcome = (
            made if made is not None else await self._store.claim(tenant, conversation_id, now, request_id)
        )
        taken = outcome.taken
        claimed = Claimed(taken, outcome.earlier, False, outcome.marker_revision)
        if not _own_turn(taken, request_id):
            return claimed
        assert taken is not None
        try:
            back = await self._store.unclaim(tenant, conversation_id, taken, outcome.marker_revision, now)
        except StoreUnavailable as e:
            # It may be back all the same (the answer lost, not the write): a release now
            # would free blocks the next turn may be handed. At worst D keeps them to its TTL.
            log.warning("lookup.own_turn.unknown", conversation_id=conversation_id, error=str(e))
            return Claimed(own=True)
        if not back:  # replaced meanwhile, past its deadline, or revoked: this one is spent
            return claimed
        log.info("lookup.own_turn", conversation_id=conversation_id, request_id=request_id)
        return Claimed(own=True)

    async def claim_guarded(self, tenant: str, conversation_id: str, request_id: str, now: float) -> Claimed:
        """`claim`, in a task of its own. Cancelled (the caller's deadline, its stream), the
        claim runs on, for one cancelled at etcd may have been written all the same, and
        what it takes goes back once it is done: never spent with no answer to anyone.

        Decided at once when its shard's owner is this replica, with the conversation in
        memory (the usual case): then there is no task, and nothing to cut short."""
        made = self._store.claim_now(tenant, conversation_id, now, request_id)
        if made is not None and not _own_turn(made.taken, request_id):
            return Claimed(made.taken, made.earlier, False, made.marker_revision)
        claiming = self._claiming(tenant, conversation_id, request_id, now, made)
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            claiming.add_done_callback(functools.partial(self._put_back_when_done, tenant, conversation_id))
            raise

    def claim_now(
        self,
        tenant: str,
        conversation_id: str,
        request_id: str,
        now: float,
        accept: Callable[[Retention | None, Claim | None], bool],
    ) -> Claimed | None:
        """`claim`, made at once, when nothing about it needs awaiting: its shard's owner is
        this replica, with the conversation in memory, and `accept` is content with what it
        would take or find (OwnedRetentions.claim_now). Never the asking request's own
        retention (that one goes straight back: an etcd write). None: nothing was claimed."""

        def taking(retention: Retention | None, earlier: Claim | None) -> bool:
            return not _own_turn(retention, request_id) and accept(retention, earlier)

        made = self._store.claim_now(tenant, conversation_id, now, request_id, taking)
        return None if made is None else Claimed(made.taken, made.earlier, False, made.marker_revision)

    async def claim_while(
        self,
        tenant: str,
        conversation_id: str,
        request_id: str,
        now: float,
        waiting: Awaitable[T],
        claimed: Callable[[Claimed], None] | None = None,
    ) -> tuple[Claimed, T]:
        """`claim_guarded` while `waiting` (the caller's prompt) is awaited; `claimed` is
        told the claim as soon as it is made, still waiting (to start what the decision
        will need). -> (the claim, what `waiting` gave)."""
        claiming = self._claiming(tenant, conversation_id, request_id, now)
        if claimed is not None:
            claiming.add_done_callback(functools.partial(_tell, claimed))
        try:
            waited = await waiting
            return await asyncio.shield(claiming), waited
        except asyncio.CancelledError:
            claiming.add_done_callback(functools.partial(self._put_back_when_done, tenant, conversation_id))
            raise

    def _claiming(
        self, tenant: str, conversation_id: str, request_id: str, now: float, made: ClaimOutcome | None = None
    ) -> asyncio.Task[Claimed]:
        """`claim` started in a task a stop waits for (Background.settle)."""
        claiming = asyncio.ensure_future(self.claim(tenant, conversation_id, request_id, now, made))
        self._background.track(claiming)
        return claiming

    def put_back(self, claimed: Claimed, tenant: str, conversation_id: str) -> asyncio.Task[None] | None:
        """Put what a claim took back, in the background: its caller went away, and no
        answer reaches anyone (a stop waits for it: see Background.settle). An etcd that
        does not answer is tried again a few times (PUT_BACK_PAUSES_S), while the
        retention is not yet past its deadline. (unclaim compares the marker's revision:
        a try that was written after all makes the next one find nothing to put back.)
        One the conversation's next registration or a revoke overtook has its blocks
        freed (`_overtaken`), when its first try found it so: after a try whose answer was
        lost, it may have gone back and out again to a pull. -> the put-back's task
        (None: nothing to put back)."""
        taken, marker = claimed.taken, claimed.marker_revision
        if claimed.own or taken is None:
            return None

        async def put_back() -> None:
            for attempt, pause in enumerate((*PUT_BACK_PAUSES_S, None), start=1):
                try:
                    back = await self._store.unclaim(tenant, conversation_id, taken, marker, self._clock())
                except StoreUnavailable as e:
                    if pause is None or self._clock() + pause >= taken.expires_at:
                        # spent, then: D frees the blocks at its TTL
                        log.warning("lookup.put_back.failed", conversation_id=conversation_id, error=str(e))
                        return
                    log.info("lookup.put_back.retry", conversation_id=conversation_id, attempt=attempt)
                    await asyncio.sleep(pause)
                    continue
                log.info("lookup.put_back", conversation_id=conversation_id, back=back, attempt=attempt)
                if not back and attempt == 1:
                    await self._overtaken(taken, tenant, conversation_id)
                elif not back:
                    # An earlier try may have put it back after all (its answer lost, not
                    # its write), and a claim since handed it out again: freeing it now
                    # could race that pull. D keeps the blocks to its TTL instead.
                    log.info("lookup.put_back.unknown", conversation_id=conversation_id, attempt=attempt)
                return

        return self._background.spawn(put_back(), "put-back")

    async def _overtaken(self, taken: Retention, tenant: str, conversation_id: str) -> None:
        """A put-back that did not go back: `taken` is spent, and when nobody else can pull
        or free its blocks (`put_back_orphan`), D's sidecar is told to free them."""
        now = self._clock()
        if taken.expires_at <= now:  # D has freed them
            return
        try:
            stored, marker = await self._store.read(tenant, conversation_id)
            current = stored.retention if stored is not None else None
            params = await self._still_held(taken, current, now)
        except StoreUnavailable as e:
            log.warning("lookup.overtaken.unchecked", conversation_id=conversation_id, error=str(e))
            return
        if params is None or not put_back_orphan(taken, current, marker is not None):
            return
        self._budgets.orphaned(tenant, conversation_id, taken, params)
        log.info(
            "lookup.overtaken.released",
            conversation_id=conversation_id,
            engine_id=taken.engine_id,
            request_id=taken.request_id,
        )

    def _put_back_when_done(self, tenant: str, conversation_id: str, done: asyncio.Future[Claimed]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.put_back(done.result(), tenant, conversation_id)

    async def note_deadline(
        self, claimed: Claimed, tenant: str, conversation_id: str, claimed_at: float, request_id: str
    ) -> None:
        """The claim (of request `request_id`, at `claimed_at`) took a retention expired or
        about to: its deadline and engine go into the marker, so that the lookups meeting
        the marker past it answer expired (`decide_claimed`), not already_claimed. (Only
        then: doing it for every claim would add an etcd write to every turn. One write
        failing leaves the marker as it was.)"""
        taken = claimed.taken
        assert taken is not None
        claim = Claim(
            claimed_at=claimed_at,
            expires_at=taken.expires_at,
            engine_id=taken.engine_id,
            claimed_by=request_id,
        )
        try:
            await self._store.note_claim_deadline(tenant, conversation_id, claimed.marker_revision, claim)
        except StoreUnavailable as e:
            log.warning("lookup.claim_deadline.failed", conversation_id=conversation_id, error=str(e))


def _own_turn(taken: Retention | None, request_id: str) -> bool:
    """Whether a claim took (or would take) the asking request's own retention (it came
    late: see `claim`)."""
    return taken is not None and bool(request_id) and taken.request_id == request_id


def _tell(claimed: Callable[[Claimed], None], done: asyncio.Future[Claimed]) -> None:
    if not done.cancelled() and done.exception() is None:
        claimed(done.result())


def put_back_orphan(taken: Retention, current: Retention | None, marked: bool) -> bool:
    """Whether a put-back that failed leaves `taken`'s blocks to nobody, the conversation
    now holding retention `current` (None: none) and a claim marker or not (`marked`).

    - `taken` is there again (the same request): back after all, for a try whose answer
      etcd lost was written (the next try then fails), or the sidecar registered it again;
    - none is there but a marker is: a later claim took what was there, which may be
      `taken` put back by such a try, handed out to be pulled: not known, so kept;
    - another retention is there (the turn's own registration overtook the put-back), or
      neither is (a revoke took the marker): `taken` is out of etcd for good. (Were it
      back first, the registration or revoke that removed it freed it, or a claim handed
      it to a turn that has registered since: a second release only logs at D.)

    (`Retentions.still_held` rules out what D freed or holds for `current` itself.)"""
    if current is not None:
        return not (
            current.params == taken.params or (taken.request_id and current.request_id == taken.request_id)
        )
    return not marked

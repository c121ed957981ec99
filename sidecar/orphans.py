"""Orphan pins: blocks D keeps for a turn whose retention the daemon does not hold.

D pins a finished turn's blocks for its ``decoder_kv_blocks_ttl`` (480 s) whenever its
answer carried kv_transfer_params; only a retention the daemon hands out (pulled, then
freed by D) or releases frees them sooner. A draft the sidecar gives up on leaves them
pinned for no one. What to do with each is `orphan_decision`, by the reason it was
dropped (the labels of ``kvferry_sidecar_lease_registrations_dropped``):

- "release": stored nowhere (never sent: "overflow", "shutdown"; overtaken:
  "superseded"; turned away unwritten: "attempts"; refused for good: "failed"). No
  retention names the blocks and none ever will: D is told to free them through a P.
- "count": maybe stored ("maybe_stored": the try reached the daemon without a clear
  answer; "cancelled": on its way when the sidecar stopped). A retention the daemon may
  hold can still be handed out, and a P pulling blocks D has freed reads another
  request's KV silently: never released from here. Counted until D's TTL frees them,
  or until a later registration of the conversation hands their release back (the
  daemon had stored them, unclaimed: `OrphanBook.resolved`).
- "gone": nothing pinned any more ("expired": D's TTL ran out; "restarted": the engine
  process that held them is gone).

`OrphanBook` keeps the pins by reason until they are released or freed, the releases
waiting for room in the releaser (a burst of them, say a queue that overflowed while the
daemon was away, goes out at the releaser's pace), and answers the blocks pinned by
reason (``kvferry_sidecar_orphan_blocks``, and with the uncaptured turns' the
UNRETAINED column of ``kvferry nodes ls``). Pure: the sender does the I/O.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

Decision = Literal["release", "count", "gone"]

UNANSWERED = "unanswered"
"""A registered retention whose claim reached nobody: claimed over the daemon's grace ago
by a turn that has not registered since (Leases/Held said PIN_ORPHAN)."""
RELEASED = frozenset({"overflow", "shutdown", "superseded", "attempts", "failed", UNANSWERED})
"""Reasons that prove no retention names the blocks (stored nowhere, ever; or no longer,
and no claim of them can still be pulled)."""
COUNTED = frozenset({"maybe_stored", "cancelled"})
"""Drop reasons that leave open whether the daemon holds a retention naming them."""
GONE = frozenset({"expired", "restarted"})
"""Drop reasons whose blocks D no longer holds."""


RETRIED = frozenset({"failed", "no_prefill", "skipped"})
"""Release outcomes worth another try: it never reached a P's engine."""
MAX_RELEASE_TRIES = 5


def orphan_decision(reason: str) -> Decision:
    """What to do with D's blocks of a draft dropped for `reason`. A reason not known
    here is counted, never released: releasing is only safe when proven."""
    if reason in RELEASED:
        return "release"
    if reason in GONE:
        return "gone"
    return "count"


def request_of(params: Mapping[str, Any] | None) -> str:
    """The D request a set of params names ("" when none)."""
    rid = params.get("remote_request_id") if params is not None else None
    return rid if isinstance(rid, str) else ""


def blocks_of(num_tokens: int, block_size: int) -> int:
    """The blocks D pins for `num_tokens` tokens (0 when the block size is not known)."""
    return math.ceil(num_tokens / block_size) if block_size > 0 and num_tokens > 0 else 0


@dataclass(frozen=True)
class Pin:
    """Blocks D pins for one turn that no retention names."""

    conversation: tuple[str, str]
    """(tenant, conversation id)."""
    params: dict[str, Any]
    """D's params, nothing to pull (``remote_num_tokens`` 0): what a release hands a P."""
    blocks: int
    expires_at: float
    """Wall-clock time D frees them itself."""
    epoch: int
    """The engine process that holds them."""
    reason: str
    """Why no retention names them (a drop reason)."""
    notifiable: bool = True
    """Whether a P could tell D to free them (its params name D's request and address)."""
    tries: int = 0
    """Releases sent for them that did not take."""


class OrphanBook:
    """Pins waiting for a release, and pins only counted, until D frees them; and the
    registered retentions' pins, until Leases/Held settles them (`registered`)."""

    def __init__(self) -> None:
        self.epoch = 0
        self._waiting: deque[Pin] = deque()
        self._counted: list[Pin] = []
        self.registered = RegisteredPins()

    def restart(self, epoch: int) -> None:
        """A new engine process, `epoch`: the old one's pins went with it."""
        self.epoch = epoch
        self._waiting.clear()
        self._counted.clear()
        self.registered.clear()

    def dropped(self, pin: Pin, now: float) -> Decision:
        """A draft was dropped with `pin.reason`: keep its pin as the decision says.
        -> what was done ("release": the pin waits in `take`; "gone" also for a pin already
        freed or of another engine process; "count" also for one whose params name no holder)."""
        decision = orphan_decision(pin.reason)
        if decision == "gone" or pin.epoch != self.epoch or pin.expires_at <= now:
            return "gone"
        if decision == "release" and pin.notifiable:
            self._waiting.append(pin)
            return "release"
        self._counted.append(pin)  # (params that name no holder: nothing can release them)
        return "count"

    def unreleased(self, pin: Pin, outcome: str, now: float) -> Decision:
        """A release of `pin` ended with `outcome` (the releaser's label) other than
        "released". -> "release": it waits again (no P known yet, the node list or the P
        failed, no room), at most MAX_RELEASE_TRIES times; "count": D still holds the blocks
        and nothing more will be tried (a P answered a release with an error, or tries ran
        out): counted until D's TTL; "gone": freed meanwhile, or the sidecar stops."""
        if outcome == "cancelled" or pin.expires_at <= now or pin.epoch != self.epoch:
            return "gone"
        pin = replace(pin, tries=pin.tries + 1)
        if outcome in RETRIED and pin.tries < MAX_RELEASE_TRIES:
            self._waiting.append(pin)
            return "release"
        self._counted.append(pin)
        return "count"

    def take(self, now: float, room: int) -> list[Pin]:
        """Up to `room` pins to release now, oldest first; pins freed meanwhile (D's TTL)
        or of an earlier engine process are forgotten on the way."""
        out: list[Pin] = []
        while self._waiting and len(out) < room:
            pin = self._waiting.popleft()
            if pin.expires_at > now and pin.epoch == self.epoch:
                out.append(pin)
        return out

    def resolved(self, conversation: tuple[str, str], released: Mapping[str, Any] | None) -> list[Pin]:
        """A later registration of `conversation` answered `released` (the params of the
        retention it replaced, which D is now told to free; None: none). A counted pin of
        that same D request was stored after all, and is released now. -> the pins forgotten."""
        rid = request_of(released)
        if not rid:
            return []
        self.registered.forget(rid)
        gone = [p for p in self._counted if p.conversation == conversation and request_of(p.params) == rid]
        self._counted = [p for p in self._counted if p not in gone]
        return gone

    @property
    def waiting(self) -> int:
        """Pins waiting for room in the releaser."""
        return len(self._waiting)

    def blocks(self, now: float) -> dict[str, int]:
        """Blocks pinned now by reason (wall-clock `now`); expired pins are forgotten."""
        self._counted = [p for p in self._counted if p.expires_at > now]
        by_reason: Counter[str] = Counter()
        for pin in (*self._waiting, *self._counted):
            if pin.expires_at > now and pin.epoch == self.epoch:
                by_reason[pin.reason] += pin.blocks
        return dict(by_reason)

    def total(self, now: float) -> int:
        """Every block pinned now with no retention naming it, of the pins here."""
        return sum(self.blocks(now).values())


HELD_ASK_AFTER_S = 120.0
"""A registered pin is asked about this long after its registration at the earliest (the
daemon's grace, controlplane.service.held: a younger one is retained or freshly claimed)."""
HELD_EVERY_S = 30.0
"""Seconds between two Leases/Held passes (a pin still retained is asked again then)."""
HELD_BATCH = 500
"""Most pins asked about in one Leases/Held call (the daemon takes up to 1000)."""
HELD_CALLS = 4
"""Most Leases/Held calls in one pass (what is left waits for the next)."""
MAX_REGISTERED = 100_000
"""Most registered pins kept (the oldest go first: left to D's TTL, as before)."""
Held = Literal["retained", "claimed", "settled", "orphan"]


@dataclass(frozen=True)
class Registered:
    """The pin of a retention the daemon acknowledged (reason UNANSWERED, should it be released)."""

    pin: Pin
    request_id: str
    """The turn's request (the retention's request_id)."""
    registered_at: float
    """Wall-clock time."""

    @property
    def remote_request_id(self) -> str:
        """D's request."""
        return request_of(self.pin.params)


class RegisteredPins:
    """D requests whose retentions were registered, by D request id, until D frees them
    (its TTL, a restart), another path releases them (`forget`: the retention replaced),
    or Leases/Held settles them (`answered`). Pure."""

    def __init__(self) -> None:
        self._pins: dict[str, Registered] = {}
        self._next_ask: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, r: Registered) -> None:
        """Keep `r` (a D request registered again replaces its earlier entry)."""
        self._pins.pop(r.remote_request_id, None)
        self._pins[r.remote_request_id] = r
        self._next_ask[r.remote_request_id] = r.registered_at
        while len(self._pins) > MAX_REGISTERED:
            self.forget(next(iter(self._pins)))

    def forget(self, remote_request_id: str) -> None:
        """Another path frees it (or will): not asked about any more."""
        self._pins.pop(remote_request_id, None)
        self._next_ask.pop(remote_request_id, None)

    def clear(self) -> None:
        """The engine process that held them is gone."""
        self._pins.clear()
        self._next_ask.clear()

    def due(
        self, now: float, epoch: int, limit: int, ask_after_s: float = HELD_ASK_AFTER_S
    ) -> list[Registered]:
        """Up to `limit` pins to ask about now (wall-clock `now`): registered `ask_after_s`
        ago at least, not asked about for HELD_EVERY_S. Those D freed (its TTL) or of an
        earlier engine process are forgotten on the way."""
        out: list[Registered] = []
        for rid, r in list(self._pins.items()):
            if r.pin.expires_at <= now or r.pin.epoch != epoch:
                self.forget(rid)
            elif len(out) < limit and r.registered_at + ask_after_s <= now and self._next_ask[rid] <= now:
                out.append(r)
        return out

    def answered(self, r: Registered, state: Held, now: float, every_s: float = HELD_EVERY_S) -> bool:
        """Leases/Held said `state` of `r`. -> whether to release it now ("orphan"). Retained
        or claimed: asked again in `every_s`; settled or orphan: forgotten."""
        rid = r.remote_request_id
        if self._pins.get(rid) is not r:  # (forgotten or registered again meanwhile)
            return False
        if state in ("retained", "claimed"):
            self._next_ask[rid] = now + every_s
            self._pins[rid] = self._pins.pop(rid)  # (last in line: `due` takes each in turn)
            return False
        self.forget(rid)
        return state == "orphan"

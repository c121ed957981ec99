"""Leases/Held: what became of the D requests a decode node's sidecar holds pinned.

D pins a finished turn's blocks until its TTL (480 s) unless a prefill node pulls them
(then D frees them) or is told to free them. A lookup's claim hands them out once; when
its answer reaches nobody (the router crashed, the stream broke after the daemon wrote
it), nothing pulls or frees them. Nobody but the router knows whether it used an answer,
but the claim marker (``claimed/<tenant>/<conv>``: who claimed, when) and the
conversation's retention (the turn that registered it) tell enough: a claim older than
HELD_GRACE_S whose turn has not registered since went nowhere. `pin_state` decides that
(pure); `HeldPins` reads them at the conversations' shard owners (controlplane.owners).

It can never name a pin an orphan while a retention names it or a claim of its
conversation is less than HELD_GRACE_S old.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controlplane.convert import remote_request_of
from controlplane.errors import InvalidArgument
from controlplane.owners import OwnedRetentions
from controlplane.records import Claim, Retention
from controlplane.service.validation import check_id, tenant_of
from controlplane.settings import Limits

HELD_GRACE_S = 120.0
"""A claim younger than this may still be pulled: a prefill node's pull of what a router
was handed can wait in P's queue. (As long as the router awaits a late lookup answer,
whose claim it then releases itself.) Past it, a claim whose turn has not registered is
taken to have reached nobody: D frees its blocks some 360 s before its TTL would."""
MAX_HELD_PINS = 1000
"""Most pins one Leases/Held call may ask about (the sidecar sends more in several)."""
_READS_AT_ONCE = 32


class PinState(enum.Enum):
    """What became of a pin's retention (the API's PinState)."""

    RETAINED = "retained"
    CLAIMED = "claimed"
    SETTLED = "settled"
    ORPHAN = "orphan"


@dataclass(frozen=True)
class Pin:
    """A D request whose retention a sidecar registered."""

    tenant: str
    conversation_id: str
    request_id: str
    """The turn's (the retention's request_id)."""
    remote_request_id: str
    """D's (remote_request_id in the registered params)."""


def pin_state(pin: Pin, current: Retention | None, marker: Claim | None, now: float) -> PinState:
    """What became of `pin`'s retention, the conversation now holding retention `current`
    and claim `marker` (None: none). Pure.

    RETAINED: `current` is it. CLAIMED: the conversation's last claim is younger than the
    grace (it may be this pin's, its pull under way). SETTLED: no claim marker (the pin
    left etcd replaced, revoked or released, and its caller frees it), the marker is of
    the pin's own turn's claim (made before the pin was registered: the pin was never
    claimed), of a claimer not known, or of a turn that has registered since (it went on
    with what it claimed). ORPHAN: claimed over the grace ago by a turn that has not
    registered since: the claim (of this pin, or a later one: then this pin's turn went
    on and D freed it on its pull) reached nobody."""
    if current is not None and (
        current.request_id == pin.request_id or remote_request_of(current.params) == pin.remote_request_id
    ):
        return PinState.RETAINED
    if marker is None:
        return PinState.SETTLED
    if now - marker.claimed_at < HELD_GRACE_S:
        return PinState.CLAIMED
    claimer = marker.claimed_by
    if not claimer or claimer == pin.request_id:
        return PinState.SETTLED
    if current is not None and current.request_id == claimer:
        return PinState.SETTLED
    return PinState.ORPHAN


class HeldPins:
    """Answers Leases/Held from the shard owners' memory (the truth; etcd trails it)."""

    def __init__(self, store: OwnedRetentions, limits: Limits, clock: Callable[[], float]) -> None:
        self._store = store
        self._limits = limits
        self._clock = clock

    def checked(self, pins: Sequence[Pin]) -> list[Pin]:
        """The pins, their ids checked (each error names the pin); tenants defaulted."""
        if len(pins) > MAX_HELD_PINS:
            raise InvalidArgument(f"{len(pins)} pins: at most {MAX_HELD_PINS} per Leases/Held call")
        out = []
        n = self._limits.max_id_bytes
        for i, p in enumerate(pins):
            try:
                tenant = tenant_of(p.tenant, n)
                check_id("conversation_id", p.conversation_id, n)
                check_id("request_id", p.request_id, n)
                check_id("remote_request_id", p.remote_request_id, n)
            except InvalidArgument as e:
                raise InvalidArgument(f"pins[{i}]: {e}") from None
            out.append(Pin(tenant, p.conversation_id, p.request_id, p.remote_request_id))
        return out

    async def states(self, pins: Sequence[Pin]) -> list[PinState]:
        """Each pin's state (`pin_state`), read from etcd (StoreUnavailable: etcd did not
        answer; the sidecar asks again later)."""
        checked = self.checked(pins)
        at_once = asyncio.Semaphore(_READS_AT_ONCE)

        async def state(pin: Pin) -> PinState:
            async with at_once:
                stored, marker = await self._store.read(pin.tenant, pin.conversation_id)
            current = stored.retention if stored is not None else None
            return pin_state(pin, current, marker, self._clock())

        return list(await asyncio.gather(*(state(p) for p in checked)))

"""Promised notice of node demotions: what lets a replica beside other replicas decide a
pull on its own view of the nodes, with no etcd read (controlplane.solewriter, rule 4).

A replica alone knows every node write since its last read: it made them. Beside others,
what it must know of is their writes that DEMOTE a node (end its liveness or give it another
generation): a view that misses any other write only thinks a node less alive than it is.
So each replica R asks every other replica O for a PROMISE (Owners/PromiseNotice, renewed
every RENEW_S), and O keeps it:

- before a demoting write, O tells R (Owners/NodeDemoting) and waits for R's answer; R
  answers once it has put that node on confirming reads (service/doubts.py: a read at most
  50 ms old before a pull, as without trust), where it stays until O tells R the write is
  over and can apply no more (Owners/NodeDemoted: written, refused, or with no answer from
  etcd settled: the node key it compares moved on, store/fenced.py `_settle`; R then
  confirms that node until a linearizable read of every node begun after it: a
  serializable one may come from a member that has not applied the write) or until R's
  read of every node finds O gone (O's later writes fail their fence, and the same read
  loaded what O wrote before; a notice that came after that read began stays);
- when R does not answer, O withdraws the promise (renews it no more) and waits until it
  has lapsed (its own clock: granted + PROMISE_S) before it writes; R's own reckoning of
  the promise ends earlier (from when R sent the request, less a margin: solewriter). O
  still tells R when it is over (the answer may have been late, not lost);
- a promise O grants anew (not a renewal) covers only the demotions O begins after it:
  O refuses it (FAILED_PRECONDITION: ask again) while a demotion that R did not answer is
  under way, and tells R of those it begins meanwhile (`Promises.ask`). Each grant has a
  number, and a renewal answers with the same one: R keeps its promise unbroken only while
  the number stays (an answer lost on the way cannot make a new grant look like a
  renewal), and trusts only a read of the nodes begun after a new grant came back
  (solewriter: a read begun later has every demotion O made before it).

A replica that joins later demotes nothing for the grace (rule 3 of solewriter), by which
time every read made without it has aged out of trust; with it, R needs its promise too.

The cost is paid by demotions (a suspension, a deregistration, an engine restart): a round
trip to each other replica first, or PROMISE_S when one does not answer. Lookups pay
nothing, and a replica unreachable by the others (no --advertise) never trusts its view.

`Promises` is the promising side's state (pure, given a clock); `NoticeSender` makes a
demotion's notices over a `NoticeTransport` (controlplane.forward.OwnerClient).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog

from controlplane import metrics
from controlplane.solewriter import SoleWriter
from kvferry.tasks import cancel_and_wait, spawn

log = structlog.get_logger(__name__)

PROMISE_S = 2.0
"""How long a promise runs from its grant (its renewal)."""
RENEW_S = 0.5
"""How often a replica renews the promises it holds."""
TELL_TIMEOUT_S = 0.5
"""How long a demotion waits for each replica's answer to its notice."""
_DONE_TRIES_S = (0.0, 0.2, 1.0, 3.0, 10.0, 30.0, 60.0)
"""When NodeDemoted is sent (after the write), and again while it is not answered."""


@dataclass
class Demotion:
    """One demoting write under way at this replica, and whom it tells."""

    engine_id: str
    number: int
    told: dict[str, str]
    """Replica id -> address: those it tells (after `Promises.unanswered`: those that answered)."""
    asked: dict[str, str] = field(default_factory=dict)
    """Those it told or tried to: each is told when it is over (an answer may be late, not lost)."""
    wait_until: float = -math.inf
    """Not written before this (monotonic): a promise to one that did not answer lapses."""


@dataclass
class Promised:
    """What this replica promised one asker, or is about to."""

    address: str
    """Where it takes the notices."""
    until: float = -math.inf
    """When its promise lapses (this clock; -inf: it holds none)."""
    grant: int = 0
    """The number of the grant its promise runs on (a renewal keeps it)."""
    withdrawn: bool = False
    """It did not answer a notice: its promise is not renewed until lapsed."""
    joining_until: float = -math.inf
    """Refused a new promise for now: told of the demotions begun meanwhile, until this."""


@dataclass
class Promises:
    """The promises this replica made to the others, and its demotions under way."""

    promise_s: float = PROMISE_S
    clock: Callable[[], float] = time.monotonic
    _askers: dict[str, Promised] = field(default_factory=dict)
    """Asker -> what it was promised (only those holding a promise or joining)."""
    _under_way: dict[int, Demotion] = field(default_factory=dict)
    _numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def ask(self, asker: str, address: str) -> int | None:
        """`asker` (at `address`) asks for a promise. -> the number of the grant it runs on
        (the same as before: renewed; another: granted anew); None: not now (a demotion
        that did not tell it is under way, or it did not answer one and its promise has not
        lapsed yet): ask again."""
        now = self.clock()
        self._forget_lapsed(now)
        a = self._askers.setdefault(asker, Promised(address))
        a.address = address
        if a.withdrawn:
            return None  # (held: not renewed until lapsed)
        if a.until > now:
            a.until = now + self.promise_s
            return a.grant
        a.joining_until = now + self.promise_s
        if any(asker not in d.told for d in self._under_way.values()):  # (told, and answered)
            return None
        a.joining_until, a.until, a.grant = -math.inf, now + self.promise_s, next(self._numbers)
        return a.grant

    def begin(self, engine_id: str) -> Demotion:
        """A demoting write of `engine_id` is about to be made: whom it must tell first
        (every promise that has not lapsed, withdrawn or not, and every asker joining)."""
        self._forget_lapsed(self.clock())
        tell = {name: a.address for name, a in sorted(self._askers.items())}
        demotion = Demotion(engine_id, next(self._numbers), tell, dict(tell))
        self._under_way[demotion.number] = demotion
        return demotion

    def _forget_lapsed(self, now: float) -> None:
        """Drop the askers whose promise and joining both lapsed (gone, or asking no more);
        of the others, a lapsed promise (and its grant, and its withdrawal)."""
        self._askers = {n: a for n, a in self._askers.items() if a.until > now or a.joining_until > now}
        for a in self._askers.values():
            if a.until <= now:
                a.until, a.grant, a.withdrawn = -math.inf, 0, False

    def unanswered(self, demotion: Demotion, asker: str) -> None:
        """`asker` did not answer `demotion`'s notice: its promise is withdrawn, and the
        write waits until it has lapsed."""
        demotion.told.pop(asker, None)
        a = self._askers.get(asker)
        if a is not None and a.until > self.clock():
            a.withdrawn = True
            demotion.wait_until = max(demotion.wait_until, a.until)

    def end(self, demotion: Demotion) -> None:
        """`demotion`'s write is over (applied, refused, or its outcome unknown)."""
        self._under_way.pop(demotion.number, None)

    def promised(self) -> int:
        """How many promises have not lapsed."""
        now = self.clock()
        return sum(1 for a in self._askers.values() if a.until > now)


class NoticeTransport(Protocol):
    """The Owners RPC's notices (controlplane.forward.OwnerClient)."""

    async def demoting(self, address: str, me: str, engine_id: str, number: int, timeout_s: float) -> str:
        """Tell the replica at `address` -> the id of the replica that answered."""
        ...

    async def demoted(self, address: str, me: str, engine_id: str, number: int, timeout_s: float) -> str: ...


class NoticeSender:
    """Makes a demotion's notices (`before` and `after` it), for NodeStore's demoting writes."""

    def __init__(self, promises: Promises, me: Callable[[], str]) -> None:
        self.promises = promises
        self._me = me
        self.transport: NoticeTransport | None = None
        """None: nobody can be told (every promise is waited out); set by the daemon."""
        self._after: set[asyncio.Task[None]] = set()

    async def before(self, engine_id: str) -> Demotion:
        """Before a demoting write of `engine_id`: every replica holding a promise told (or
        its promise waited out). -> the demotion, under way until `after` (however the tells
        ended, `after` has been called when this raises)."""
        demotion = self.promises.begin(engine_id)
        try:
            if demotion.told:
                await self._tell(demotion)
        except BaseException:
            self.after(demotion)
            raise
        return demotion

    def after(self, demotion: Demotion) -> None:
        """The write is over, and cannot apply later: applied, refused, never sent, or its
        outcome settled (store.fenced). Those asked are told, from a task of its own."""
        self.promises.end(demotion)
        if demotion.asked:
            spawn(self._done(demotion), self._after)

    async def _tell(self, demotion: Demotion) -> None:
        asked = dict(demotion.told)
        answers = await asyncio.gather(
            *(self._call(a, address, demotion, done=False) for a, address in asked.items())
        )
        for asker, answered in zip(asked, answers, strict=True):
            metrics.DEMOTION_NOTICES.labels("answered" if answered else "unanswered").inc()
            if not answered:
                self.promises.unanswered(demotion, asker)
        wait = demotion.wait_until - self.promises.clock()
        if wait > 0:
            log.info("notices.waiting_out", engine_id=demotion.engine_id, wait_s=round(wait, 3))
            await asyncio.sleep(wait)

    async def _done(self, demotion: Demotion) -> None:
        left = dict(demotion.asked)
        for delay in _DONE_TRIES_S:
            await asyncio.sleep(delay)
            answers = await asyncio.gather(
                *(self._call(a, address, demotion, done=True) for a, address in left.items())
            )
            left = {a: address for (a, address), ok in zip(left.items(), answers, strict=True) if not ok}
            if not left:
                return
        # (they confirm that node by reads until they find this replica gone: safe, slower)
        log.info("notices.done_untold", engine_id=demotion.engine_id, replicas=sorted(left))

    async def _call(self, asker: str, address: str, demotion: Demotion, done: bool) -> bool:
        """One notice to `asker` -> whether it answered as itself."""
        transport = self.transport
        if transport is None or not address:
            return False
        call = transport.demoted if done else transport.demoting
        try:
            answerer = await call(address, self._me(), demotion.engine_id, demotion.number, TELL_TIMEOUT_S)
        except Exception as e:  # (unreachable, late, refused: not answered)
            log.info("notices.untold", replica=asker, address=address, done=done, error=str(e))
            return False
        return answerer == asker

    async def close(self) -> None:
        """Stop the NodeDemoted sends still under way."""
        await cancel_and_wait(list(self._after))


class PromiseAsker(Protocol):
    """The Owners RPC's PromiseNotice (controlplane.forward.OwnerClient)."""

    async def promise(self, address: str, me: str, my_address: str, timeout_s: float) -> Any: ...


async def hold_promises(writer: SoleWriter, asker: PromiseAsker, my_address: str) -> None:
    """Ask every other replica the latest read of the nodes found for its promise, and
    renew it, every RENEW_S, until cancelled (the writer keeps them: solewriter, rule 4).
    A replica others cannot reach (no address) asks nobody: it never trusts beside them."""
    while True:
        if writer.lease and my_address:
            others = [(r, address) for r, address in writer.others.items() if address]
            await asyncio.gather(*(_renew(writer, asker, r, address, my_address) for r, address in others))
        await asyncio.sleep(RENEW_S)


async def _renew(
    writer: SoleWriter, asker: PromiseAsker, replica: str, address: str, my_address: str
) -> None:
    sent = writer.now()
    try:
        answer = await asker.promise(address, writer.me, my_address, RENEW_S)
    except grpc.aio.AioRpcError as e:
        if e.code() is grpc.StatusCode.FAILED_PRECONDITION:  # (it answered: not now)
            writer.unpromised(replica)
        log.debug("notices.promise_failed", replica=replica, code=e.code().name, details=e.details())
        return
    except Exception:  # (a defect: logged; the promises are asked again next round)
        log.exception("notices.promise_crashed", replica=replica)
        return
    if answer.replica != replica:  # (another replica at that address now)
        writer.unpromised(replica)
        return
    writer.promised(replica, sent, answer.seconds, answer.grant)

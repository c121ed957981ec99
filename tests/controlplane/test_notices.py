"""Promised notice of node demotions (controlplane.notices): the promising side's rules on
plain data, a demotion's notices over a transport that answers, fails or hangs, and the
seeded model (sole_model.py) of replicas beside each other, each deciding pulls on its own
view while it holds the others' promises: none ever decides on a view another replica has
written past, and each broken rule is caught; then what keeps a node in doubt
(service.doubts) and the settling of a demoting write etcd did not answer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from controlplane import notices
from controlplane.errors import StoreUnavailable
from controlplane.notices import NoticeSender, Promised, Promises
from controlplane.records import NodeRecord, Role
from controlplane.service.doubts import Doubts
from controlplane.solewriter import SoleWriter
from controlplane.store import EtcdStore
from controlplane.store.fenced import Unobserved
from tests.controlplane.sole_model import Clock, run, schedules
from tests.polling import eventually


def test_a_promise_is_granted_then_renewed_until_it_lapses() -> None:
    clock = Clock()
    p = Promises(2.0, clock)
    grant = p.ask("b", "b:1")
    assert grant is not None
    clock.now += 1.5
    assert p.ask("b", "b:1") == grant  # (renewed: 2 s from now, on the same grant)
    clock.now += 1.9
    assert p.promised() == 1 and list(p.begin("d-1").told) == ["b"]
    clock.now += 0.2
    assert p.promised() == 0
    again = p.ask("b", "b:1")
    assert again is not None and again != grant  # (lapsed: a new one)


def test_a_new_promise_waits_for_the_demotions_that_did_not_tell_the_asker() -> None:
    clock = Clock()
    p = Promises(2.0, clock)
    untold = p.begin("d-1")
    assert untold.told == {}
    assert p.ask("b", "b:1") is None  # (not now)
    meanwhile = p.begin("d-2")
    assert meanwhile.told == {"b": "b:1"}  # (a joining asker is told of those begun since)
    p.end(untold)
    assert p.ask("b", "b:1") is not None


def test_an_asker_that_did_not_answer_has_its_promise_waited_out_and_withdrawn() -> None:
    clock = Clock()
    p = Promises(2.0, clock)
    first = p.ask("b", "b:1")
    p.ask("c", "c:1")
    clock.now += 1.0
    demotion = p.begin("d-1")
    p.unanswered(demotion, "b")
    assert demotion.told == {"c": "c:1"} and demotion.wait_until == clock.now + 1.0
    assert demotion.asked == {"b": "b:1", "c": "c:1"}  # (both told when it is over)
    assert p.ask("b", "b:1") is None  # (no renewal of a withdrawn promise)
    later = p.begin("d-2")
    assert "b" in later.told  # (told again: its promise has not lapsed)
    p.end(demotion)
    p.end(later)
    clock.now += 1.01
    assert p.ask("b", "b:1") not in (None, first)  # (lapsed: granted anew)


def test_a_holder_trusts_its_view_beside_another_only_on_a_read_begun_after_the_promise() -> None:
    clock = Clock()
    w = SoleWriter(3.0, 0.5, clock)
    w.announced("a", 1, clock.now, 30)
    w.saw({"a": "a:1", "b": "b:1"}, clock.now, with_view=True)
    assert not w.trusted() and w.others == {"b": "b:1"}
    sent = clock.now
    clock.now += 0.01
    w.promised("b", sent, 2.0, grant=7)
    assert not w.trusted()  # (that read began before the promise)
    w.saw({"a": "a:1", "b": "b:1"}, clock.now, with_view=True)
    assert w.trusted()
    clock.now += 1.0
    w.promised("b", clock.now, 2.0, grant=7)
    clock.now += 1.0
    assert w.trusted()
    w.promised("b", clock.now, 2.0, grant=9)  # (broken meanwhile: a new grant)
    assert not w.trusted()
    w.saw({"a": "a:1", "b": "b:1"}, clock.now, with_view=True)
    assert w.trusted()
    clock.now += 1.5  # (its own reckoning: sent + 2 s - the margin)
    assert not w.trusted()


class _Transport:
    """Answers NodeDemoting/NodeDemoted as `answers` says (per address: an id, an error,
    or never), and records what it was told, when."""

    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str, float]] = []

    async def _answer(self, kind: str, address: str) -> str:
        self.calls.append((kind, address, time.monotonic()))
        answer = self.answers[address]
        if answer is None:
            await asyncio.get_running_loop().create_future()  # (hung)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, str)
        return answer

    async def demoting(self, address: str, me: str, engine_id: str, number: int, timeout_s: float) -> str:
        async with asyncio.timeout(timeout_s):
            return await self._answer("demoting", address)

    async def demoted(self, address: str, me: str, engine_id: str, number: int, timeout_s: float) -> str:
        async with asyncio.timeout(timeout_s):
            return await self._answer("demoted", address)


async def test_a_demotion_tells_first_and_says_when_it_is_over() -> None:
    promises = Promises(2.0)
    promises.ask("b", "b:1")
    sender = NoticeSender(promises, lambda: "a")
    sender.transport = transport = _Transport({"b:1": "b"})
    demotion = await sender.before("d-1")
    written = time.monotonic()
    assert [c[:2] for c in transport.calls] == [("demoting", "b:1")]
    sender.after(demotion)
    await eventually(lambda: len(transport.calls) == 2)  # (sent after the write, from a task of its own)
    assert transport.calls[1][:2] == ("demoted", "b:1") and transport.calls[1][2] >= written
    await sender.close()


@pytest.mark.parametrize(
    "answer", [None, RuntimeError("refused"), "not-b"], ids=["hung", "failed", "another"]
)
async def test_a_demotion_unanswered_waits_until_the_promise_has_lapsed(answer: object) -> None:
    promises = Promises(0.8)
    promises.ask("b", "b:1")
    granted = time.monotonic()
    sender = NoticeSender(promises, lambda: "a")
    sender.transport = _Transport({"b:1": answer})
    demotion = await sender.before("d-1")
    assert time.monotonic() >= granted + 0.8
    sender.after(demotion)
    assert promises.ask("b", "b:1") is not None  # (withdrawn, lapsed: granted anew)
    await sender.close()


async def test_with_nobody_to_tell_a_demotion_goes_at_once() -> None:
    sender = NoticeSender(Promises(2.0), lambda: "a")
    began = time.monotonic()
    sender.after(await sender.before("d-1"))
    assert time.monotonic() - began < notices.TELL_TIMEOUT_S


SCHEDULES = 5000
"""Seeded schedules of 100 actions each (about 2 s of this machine per 5,000)."""


@pytest.mark.parametrize("seed", [29, 1, 2])
def test_no_replica_decides_on_a_view_another_replica_has_written_past(seed: int) -> None:
    beside = 0
    for i, (actions, n) in enumerate(schedules(seed=seed, count=SCHEDULES)):
        beside += run(actions, n, seed=seed * SCHEDULES + i).beside
    assert beside > 20_000, beside  # (not vacuous: many checks found one deciding alone beside another)


def _ask_never_refuses(self: Promises, asker: str, address: str) -> int | None:
    now = self.clock()
    a = self._askers.setdefault(asker, Promised(address))
    if a.until <= now:
        a.grant = next(self._numbers)
    a.address, a.until = address, now + self.promise_s
    return a.grant


_promised = SoleWriter.promised
_saw = SoleWriter.saw
BROKEN = {
    # A new promise granted while a demotion that did not tell the asker is under way.
    (Promises, "ask"): _ask_never_refuses,
    # A demotion unanswered goes ahead without waiting the promise out.
    (Promises, "unanswered"): lambda self, demotion, asker: demotion.told.pop(asker, None),
    # A holder takes every promise as a renewal (a broken one as unbroken).
    (SoleWriter, "promised"): lambda self, replica, sent, seconds, grant: _promised(
        self, replica, sent, seconds, self._promises.get(replica, (0, 0, grant))[2]
    ),
    # A view read before another replica's promise came back counts as one made after it.
    (SoleWriter, "saw"): lambda self, replicas, started, with_view=False: (
        _saw(self, replicas, started, with_view),
        setattr(self, "_view_others", frozenset()) if with_view and self.me in replicas else None,
    ),
}


@pytest.mark.parametrize("broken", sorted(BROKEN, key=str), ids=lambda b: f"{b[0].__name__}.{b[1]}")
def test_the_model_finds_a_broken_notice_rule(
    broken: tuple[type, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(*broken, BROKEN[broken])
    caught = 0
    for i, (actions, n) in enumerate(schedules(seed=29, count=SCHEDULES)):
        try:
            run(actions, n, seed=i)
        except AssertionError:
            caught += 1
    assert caught >= 2, caught


class _Told(Unobserved):
    """A NodeWrites that records what it is told of doubt."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def unsure(self, engine_id: str, settled: bool = True) -> None:
        self.events.append(("unsure", engine_id, str(settled)))

    def settled(self, engine_id: str) -> None:
        self.events.append(("settled", engine_id))


async def test_a_demoting_write_with_no_answer_is_settled_before_it_is_over(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd may apply a write whose answer never came: the node stays in doubt until the
    key it compares has moved on (here moved by the settling itself, to its own value), so
    the write can never apply later."""
    rec = NodeRecord("d-1", Role.DECODE, "m", 16, "http://d", "10.0.0.7", 5600, 1, time.time(), 30)
    stored, _ = await store.nodes.put(rec, 0)
    told = _Told()
    store.nodes.observer = told
    real = store.kv.txn

    async def no_answer(op: str, *args: Any) -> Any:
        if op == "suspend_node":
            raise StoreUnavailable("etcd did not answer in time")
        return await real(op, *args)

    monkeypatch.setattr(store.kv, "txn", no_answer)
    _, compared = await store.nodes.get("d-1")
    with pytest.raises(StoreUnavailable):
        await store.nodes.suspend(stored, time.time())
    assert told.events[0] == ("unsure", "d-1", "False")
    await eventually(lambda: ("settled", "d-1") in told.events)
    state, revision = await store.nodes.get("d-1")
    assert revision > compared and state is not None and state.record == stored  # (moved on, unchanged)


def test_a_notice_over_is_covered_only_by_a_read_of_every_node_begun_later() -> None:
    """Only NodeStore.load (linearizable) covers another replica's demotion: a serializable
    confirming read may come from an etcd member that has not applied it yet."""
    writer = SoleWriter()
    writer.announced("a", 1, time.monotonic(), 30)
    writer.saw({"a": "a:1"}, time.monotonic(), with_view=True)
    doubts = Doubts(writer)
    assert doubts.sole("d-1")
    doubts.demoting("d-1", "b", 4)
    assert not doubts.sole("d-1")
    doubts.demoted("d-1", "b", 4)
    doubts.read("d-1", time.monotonic() + 1)
    assert not doubts.sole("d-1")
    doubts.loaded(time.monotonic() + 1)
    assert doubts.sole("d-1")
    doubts.demoting("d-1", "b", 4)  # (a notice that comes after its end)
    assert doubts.sole("d-1")


def test_a_notice_from_a_replica_a_load_found_gone_is_dropped_only_if_it_came_before() -> None:
    writer = SoleWriter()
    writer.announced("a", 1, time.monotonic(), 30)
    doubts = Doubts(writer)
    doubts.demoting("d-1", "b", 1)
    began = time.monotonic()
    doubts.demoting("d-2", "b", 2)  # (came while that load was on its way: b may be back)
    writer.saw({"a": "a:1"}, began, with_view=True)
    doubts.loaded(began)
    assert doubts.sole("d-1") and not doubts.sole("d-2")


def test_an_unsettled_write_is_covered_by_no_read_until_settled() -> None:
    writer = SoleWriter()
    writer.announced("a", 1, time.monotonic(), 30)
    writer.saw({"a": "a:1"}, time.monotonic(), with_view=True)
    doubts = Doubts(writer)
    doubts.unsure("d-1", settled=False)
    doubts.loaded(time.monotonic() + 1)
    assert not doubts.sole("d-1")
    doubts.settled("d-1")
    doubts.read("d-1", time.monotonic() + 1)
    assert doubts.sole("d-1")

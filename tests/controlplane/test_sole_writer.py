"""When a replica may trust its own view of the nodes (controlplane.solewriter): the rule
on plain data, and checked on seeded random schedules of replicas announcing, reading, writing
and lapsing against a model of etcd (tests/controlplane/sole_model.py; here with no promises
of notice: test_notices.py has them)."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.errors import StoreUnavailable
from controlplane.solewriter import SoleWriter
from tests.controlplane.sole_model import Action, Clock, run, schedules


def writer(clock: Clock) -> SoleWriter:
    return SoleWriter(grace_s=3.0, margin_s=0.5, clock=clock)


def test_a_replica_alone_writes_at_once_and_trusts_its_view_for_the_grace_less_the_margin() -> None:
    clock = Clock()
    w = writer(clock)
    assert not w.trusted() and not w.may_write()
    w.announced("a", 7, sent=clock.now, ttl_s=10)
    assert not w.may_write()  # (until a read after the announcement shows who else is there)
    clock.now += 0.1
    w.saw({"a"}, started=clock.now, with_view=True)
    assert w.may_write() and w.trusted()
    clock.now += 2.49
    assert w.trusted()
    clock.now += 0.02
    assert not w.trusted() and w.may_write()  # (2.5 s after that read: a read again first)
    w.saw({"a"}, started=clock.now, with_view=True)
    assert w.trusted()


def test_a_read_of_the_replicas_alone_lets_it_write_but_not_trust_its_view() -> None:
    """Peers reads only the announcements: a replica that wrote and left between the view's
    load and that read may have written what the view lacks."""
    clock = Clock()
    w = writer(clock)
    w.announced("a", 7, sent=clock.now, ttl_s=10)
    w.saw({"a"}, started=clock.now)
    assert w.may_write() and not w.trusted()
    w.saw({"a"}, started=clock.now, with_view=True)
    assert w.trusted()


def test_a_replica_that_finds_others_writes_only_after_the_grace_and_never_trusts() -> None:
    clock = Clock()
    w = writer(clock)
    w.announced("b", 8, sent=clock.now, ttl_s=10)
    announced_at = clock.now
    w.saw({"a", "b"}, started=clock.now)
    assert not w.may_write() and not w.trusted()
    clock.now = announced_at + 2.99
    assert not w.may_write()
    clock.now = announced_at + 3.0
    assert w.may_write() and not w.trusted()
    w.saw({"a", "b"}, started=clock.now)
    assert not w.trusted()


def test_a_write_that_demotes_no_node_needs_only_the_announcement() -> None:
    clock = Clock()
    w = writer(clock)
    assert not w.may_write(demotes=False)
    w.announced("b", 8, sent=clock.now, ttl_s=10)
    w.saw({"a", "b"}, started=clock.now)
    assert w.may_write(demotes=False) and not w.may_write()


def test_a_read_begun_before_the_announcement_says_nothing() -> None:
    clock = Clock()
    w = writer(clock)
    begun = clock.now
    clock.now += 0.01
    w.announced("a", 7, sent=clock.now, ttl_s=10)
    w.saw({"a"}, started=begun, with_view=True)
    assert not w.may_write() and not w.trusted()


def test_trust_ends_with_the_announcements_proven_life_and_with_its_lease() -> None:
    clock = Clock()
    w = writer(clock)
    w.announced("a", 7, sent=clock.now, ttl_s=2)
    w.saw({"a"}, started=clock.now, with_view=True)
    clock.now += 1.49
    assert w.trusted()
    clock.now += 0.02  # (sent + TTL - margin: etcd may let the key lapse soon)
    assert not w.trusted()
    w.refreshed(7, sent=clock.now, ttl_s=2)
    assert w.trusted()
    w.refreshed(7, sent=clock.now, ttl_s=0)  # (the lease was gone)
    assert not w.trusted() and not w.may_write() and w.lease == 0
    w.announced("a", 9, sent=clock.now, ttl_s=2)
    w.saw({"b"}, started=clock.now)  # (its own key missing: no trust, and others are there)
    assert not w.trusted() and not w.may_write()


async def test_the_fence_waits_for_the_grace_and_gives_up_with_a_clear_error() -> None:
    w = SoleWriter(grace_s=0.2, margin_s=0.05)
    with pytest.raises(StoreUnavailable, match="not announced"):
        await w.fence(0.05)
    loop = asyncio.get_running_loop()
    w.announced("b", 8, sent=loop.time(), ttl_s=10)
    waiting = asyncio.ensure_future(w.fence(5.0))
    w.saw({"a", "b"}, started=loop.time() + 0.001)
    assert await waiting == 8
    assert w.may_write()


def _run(actions: list[Action], replicas: int) -> None:
    run(actions, replicas, notices=False)


def _schedules(seed: int, count: int) -> list[tuple[list[Action], int]]:
    return [([a for a in actions if a[1] != "promise"], n) for actions, n in schedules(seed, count)]


def test_no_replica_trusts_a_view_another_replica_has_written_past() -> None:
    for actions, n in _schedules(seed=23, count=1500):
        _run(actions, n)


_saw = SoleWriter.saw
BROKEN_RULES = {
    # Rule 3 off: a replica writes as soon as it is announced.
    "may_write": lambda self: bool(self.lease),
    # Rule 1 half off: a read of the replicas alone (Peers') also makes the view trusted.
    "saw": lambda self, replicas, started, with_view=False: _saw(self, replicas, started, True),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_RULES))
def test_the_model_finds_a_broken_rule(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker is not vacuous: with a rule broken, the same schedules catch a replica
    trusting a view another replica has written past."""
    monkeypatch.setattr(SoleWriter, broken, BROKEN_RULES[broken])
    caught = 0
    for actions, n in _schedules(seed=23, count=1500):
        try:
            _run(actions, n)
        except AssertionError:
            caught += 1
    assert caught >= 10, caught


def test_a_replica_that_writes_without_waiting_out_the_grace_is_caught() -> None:
    """A schedule built for it: the other replica trusts a read from just before."""
    actions: list[Action] = [
        (0, "announce", 0.0, 0.0, 0.0),
        (0, "read", 0.1, 0.0, 0.0),  # r0 alone: trusts its view
        (1, "announce", 0.1, 0.0, 0.0),
        (1, "read", 0.1, 0.0, 0.0),  # r1 finds r0: may write from its announcement + 3 s
        (1, "write", 0.1, 0.0, 0.0),
        (0, "read", 0.1, 0.0, 0.0),
    ]
    _run(actions, 2)  # (holds: r1's write is refused until the grace is over)
    original = SoleWriter.may_write
    try:
        SoleWriter.may_write = lambda self: bool(self.lease)  # type: ignore[method-assign]
        with pytest.raises(AssertionError):
            _run(actions, 2)
    finally:
        SoleWriter.may_write = original  # type: ignore[method-assign]

"""Where a release goes (service.budgets.Budgets.queue, service.relay): on the node's
stream when its sidecar is attached to this replica, else held and offered to the other
replicas until one takes it, the node attaches here, or its deadline passes; releases
not sent when a stream ends follow the sidecar. No I/O."""

from __future__ import annotations

from typing import cast

from controlplane.budget import Budget, Reason
from controlplane.owners import OwnedRetentions
from controlplane.service.budgets import Budgets, Release

NOW = 1000.0


def _budgets() -> Budgets:
    return Budgets(cast(OwnedRetentions, None), Budget(0.5, 0.9), lambda: NOW)


def _release(conversation_id: str, expires_at: float = NOW + 60) -> Release:
    return Release("default", conversation_id, b"params", Reason.FAILOVER, expires_at)


class Peers:
    """The other replicas: whether one has the node attached; what was offered."""

    def __init__(self, taken: bool) -> None:
        self.taken = taken
        self.offered: list[tuple[str, list[str]]] = []

    async def offer(self, engine_id: str, releases: list[Release]) -> bool:
        self.offered.append((engine_id, [r.conversation_id for r in releases]))
        return self.taken


def _woken(budgets: Budgets, engine_id: str) -> list[int]:
    wakes: list[int] = []
    budgets.attached(engine_id, lambda: wakes.append(1))
    return wakes


async def test_a_node_attached_here_is_told_on_its_stream() -> None:
    budgets = _budgets()
    wakes = _woken(budgets, "d-1")
    budgets.queue("d-1", _release("c"))
    assert wakes and [r.conversation_id for r in budgets.take_releases("d-1")] == ["c"]
    assert budgets.relay.held == 0


async def test_a_node_attached_elsewhere_gets_it_through_the_replica_that_takes_it() -> None:
    budgets, peers = _budgets(), Peers(taken=True)
    budgets.relay.offer = peers.offer
    budgets.queue("d-1", _release("c"))
    assert budgets.take_releases("d-1") == [] and budgets.relay.held == 1
    await budgets.relay.deliver()
    assert peers.offered == [("d-1", ["c"])] and budgets.relay.held == 0
    await budgets.relay.deliver()
    assert len(peers.offered) == 1  # (taken: offered no more)


async def test_one_nobody_takes_is_offered_again_then_told_where_the_node_attaches() -> None:
    budgets, peers = _budgets(), Peers(taken=False)
    budgets.relay.offer = peers.offer
    budgets.queue("d-1", _release("c"))
    await budgets.relay.deliver()
    await budgets.relay.deliver()
    assert peers.offered == [("d-1", ["c"])] * 2 and budgets.relay.held == 1
    _woken(budgets, "d-1")  # (it attached here)
    assert [r.conversation_id for r in budgets.take_releases("d-1")] == ["c"]
    assert budgets.relay.held == 0


async def test_releases_not_sent_when_a_stream_ends_follow_the_sidecar() -> None:
    budgets, peers = _budgets(), Peers(taken=True)
    budgets.relay.offer = peers.offer
    _woken(budgets, "d-1")
    budgets.queue("d-1", _release("c"))
    budgets.forget("d-1")  # (its stream ended before the release went out)
    assert budgets.take_releases("d-1") == [] and budgets.relay.held == 1
    await budgets.relay.deliver()
    assert peers.offered == [("d-1", ["c"])]


async def test_one_past_its_deadline_is_dropped_for_d_freed_the_blocks() -> None:
    budgets, peers = _budgets(), Peers(taken=False)
    budgets.relay.offer = peers.offer
    budgets.queue("d-1", _release("late", expires_at=NOW))
    budgets.queue("d-1", _release("c"))
    await budgets.relay.deliver()
    assert peers.offered == [("d-1", ["c"])] and budgets.relay.held == 1


async def test_a_failing_offer_keeps_them() -> None:
    budgets = _budgets()

    async def broken(engine_id: str, releases: list[Release]) -> bool:
        raise RuntimeError("a defect")

    budgets.relay.offer = broken
    budgets.queue("d-1", _release("c"))
    await budgets.relay.deliver()
    assert budgets.relay.held == 1

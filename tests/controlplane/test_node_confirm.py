"""The confirming reads of a node (controlplane.service.nodecache): they overlap when etcd
is slow, so the CONFIRM_S window holds; one that comes back late never undoes a newer one."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from controlplane.records import NodeRecord, NodeState, Role
from controlplane.service import nodecache
from controlplane.service.nodecache import NodeCache
from tests.polling import eventually


def _state(generation: int) -> NodeState:
    rec = NodeRecord("d-1", Role.DECODE, "m", 16, "http://d", "10.0.0.7", 5600, generation, time.time(), 30)
    return NodeState(rec, True)


class HeldReads:
    """A NodeStore whose reads answer only when the test says, in any order."""

    def __init__(self) -> None:
        self.reads: list[asyncio.Future[tuple[NodeState | None, int]]] = []

    async def get(self, engine_id: str, serializable: bool = False) -> tuple[NodeState | None, int]:
        assert engine_id == "d-1" and serializable
        answer: asyncio.Future[tuple[NodeState | None, int]] = asyncio.get_running_loop().create_future()
        self.reads.append(answer)
        return await answer


async def test_a_read_back_late_does_not_bring_back_a_node_a_newer_read_found_gone() -> None:
    """Reads overlap and may come back out of order (another etcd member, a slow one): the
    older one's answer is dropped, and the window runs from the newer one's start."""
    store = HeldReads()
    cache = NodeCache(store, refresh_s=1.0)  # type: ignore[arg-type]
    first = asyncio.ensure_future(cache._confirmed("d-1"))
    await eventually(lambda: len(store.reads) == 1)
    cache._start_read("d-1", time.monotonic())  # (as keep_confirmed does, a pace later)
    await eventually(lambda: len(store.reads) == 2)
    store.reads[1].set_result((None, 0))  # the newer read: the record is gone
    await eventually(lambda: "d-1" in cache._confirmed_at)
    newer = cache._confirmed_at["d-1"]
    store.reads[0].set_result((_state(1), 5))  # the older read, as it was before
    assert await first is None
    assert cache.snapshot() == {} and cache._confirmed_at["d-1"] == newer
    assert cache._confirming == {}  # (both done: nothing left on its way)


async def test_a_kept_node_is_read_again_while_a_slow_read_is_on_its_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One read at a time, a read slower than the pace let the window lapse and every lookup
    wait for etcd; kept reads overlap instead, at most MAX_IN_FLIGHT, and the first one
    back confirms the node."""
    monkeypatch.setattr(nodecache, "KEEP_PACE_S", 0.002)
    store = HeldReads()
    cache = NodeCache(store, refresh_s=1.0)  # type: ignore[arg-type]
    cache._note_lookup("d-1")
    old, new = _state(1), _state(2)
    keeping = asyncio.create_task(cache.keep_confirmed())
    try:
        await eventually(lambda: len(store.reads) == nodecache.MAX_IN_FLIGHT)
        keeping.cancel()  # (no more reads from here: the test answers those on their way)
        assert len(cache._confirming["d-1"]) == nodecache.MAX_IN_FLIGHT
        store.reads[-1].set_result((new, 9))  # the newest comes back first
        await eventually(lambda: cache.snapshot().get("d-1") == new)
        assert cache._confirmed_within("d-1", nodecache.CONFIRM_S, time.monotonic())
        for read in store.reads[:-1]:  # the older ones, later: dropped
            read.set_result((old, 5))
        await eventually(lambda: "d-1" not in cache._confirming)
        assert cache.snapshot()["d-1"] == new
    finally:
        keeping.cancel()
        for read in store.reads:
            if not read.done():
                read.set_result((None, 0))


def _confirm_waits() -> float:
    return REGISTRY.get_sample_value("kvferry_lookup_wait_seconds_count", {"on": "node_confirm"}) or 0.0


async def test_a_lookup_that_waits_for_its_confirming_read_is_timed() -> None:
    """kvferry_lookup_wait_seconds{on="node_confirm"} counts the lookups that waited on etcd
    for the read (and how long); one that finds a read back within the window is not counted."""
    store = HeldReads()
    cache = NodeCache(store, refresh_s=1.0)  # type: ignore[arg-type]
    before, state = _confirm_waits(), _state(1)
    waiting = asyncio.ensure_future(cache._confirmed("d-1"))
    await eventually(lambda: len(store.reads) == 1)
    store.reads[0].set_result((state, 5))
    assert await waiting == state
    assert _confirm_waits() == before + 1
    assert await cache._confirmed("d-1") == state  # (the same read, back: no wait)
    assert _confirm_waits() == before + 1 and len(store.reads) == 1

"""The owners' write-behind (controlplane.owners.writeback) against a recording store:
claims' writes gather into one transaction, a write someone waits for leaves at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from controlplane.owners import writeback
from controlplane.owners.memory import ShardMemory, Target, Write
from controlplane.owners.writeback import WriteBehind


class RecordingStore:
    """An OwnerStore that keeps each transaction's writes instead of sending them."""

    def __init__(self) -> None:
        self.transactions: list[list[Write]] = []
        self.sent = asyncio.Event()

    async def write(self, fences: dict[int, int], writes: list[Write], now: float) -> int:
        self.transactions.append(writes)
        self.sent.set()
        return len(self.transactions)


def _claim(n: int) -> list[Write]:
    """A claim's writes: the retention deleted (its marker is a put; one write is enough here)."""
    return [Write(Target.RETENTION, ("t", f"c{n}"), None)]


async def _started(store: RecordingStore) -> tuple[WriteBehind, asyncio.Task[None]]:
    behind = WriteBehind(store, time.time, lambda shards: None)  # type: ignore[arg-type]
    return behind, asyncio.create_task(behind.run())


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_claims_writes_gather_into_one_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 60.0)  # (the registration below ends the wait)
    store = RecordingStore()
    behind, task = await _started(store)
    memory = ShardMemory(marker_s=60)
    try:
        behind.add(0, 1, memory, _claim(1), wait=False)
        for _ in range(5):  # the sender runs, and lingers (it used to send the claim alone)
            await asyncio.sleep(0)
        behind.add(1, 1, memory, _claim(2), wait=False)
        done = behind.add(2, 1, memory, _claim(3), wait=True)
        assert done is not None
        assert await asyncio.wait_for(done, 10) == 1
        assert [len(t) for t in store.transactions] == [3]
    finally:
        await _stop(task)


async def test_a_write_waited_for_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 60.0)
    store = RecordingStore()
    behind, task = await _started(store)
    try:
        done = behind.add(0, 1, ShardMemory(marker_s=60), _claim(1), wait=True)
        assert done is not None
        assert await asyncio.wait_for(done, 10) == 1  # (not after the 60 s linger)
    finally:
        await _stop(task)


async def test_claims_alone_leave_after_the_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 0.05)
    store = RecordingStore()
    behind, task = await _started(store)
    try:
        for n in range(3):
            behind.add(n, 1, ShardMemory(marker_s=60), _claim(n), wait=False)
        await asyncio.wait_for(behind.flush(), 10)
        assert [len(t) for t in store.transactions] == [3]
    finally:
        await _stop(task)


async def test_a_full_transactions_worth_leaves_without_lingering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 60.0)
    store = RecordingStore()
    behind, task = await _started(store)
    try:
        behind.add(0, 1, ShardMemory(marker_s=60), _claim(0), wait=False)
        for _ in range(5):
            await asyncio.sleep(0)
        for n in range(1, writeback.MAX_OPS):
            behind.add(n, 1, ShardMemory(marker_s=60), _claim(n), wait=False)
        await asyncio.wait_for(behind.flush(), 10)
        assert sum(len(t) for t in store.transactions) == writeback.MAX_OPS
    finally:
        await _stop(task)

"""The owners' write-behind (controlplane.owners.writeback) against a recording store:
claims' writes gather into one transaction, a write someone waits for leaves at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from controlplane.owners import writeback
from controlplane.owners.memory import Conversation, ShardMemory, Target, Write
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
    return [Write(Target.RETENTION, Conversation("t", f"c{n}"), None)]


@pytest.fixture
async def store() -> RecordingStore:
    return RecordingStore()


@pytest.fixture
async def behind(store: RecordingStore) -> AsyncIterator[WriteBehind]:
    """A write-behind sending to `store`, running until the test ends."""
    behind = WriteBehind(store, time.time, lambda shards: None)  # type: ignore[arg-type]
    task = asyncio.create_task(behind.run())
    yield behind
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_claims_writes_gather_into_one_transaction(
    monkeypatch: pytest.MonkeyPatch, store: RecordingStore, behind: WriteBehind
) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 60.0)  # (the registration below ends the wait)
    memory = ShardMemory(marker_s=60)
    behind.add(0, 1, memory, _claim(1), wait=False)
    for _ in range(5):  # the sender runs, and lingers (it used to send the claim alone)
        await asyncio.sleep(0)
    behind.add(1, 1, memory, _claim(2), wait=False)
    done = behind.add(2, 1, memory, _claim(3), wait=True)
    assert done is not None
    assert await asyncio.wait_for(done, 10) == 1
    assert [len(t) for t in store.transactions] == [3]


async def test_a_write_waited_for_leaves_at_once(
    monkeypatch: pytest.MonkeyPatch, behind: WriteBehind
) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 60.0)
    done = behind.add(0, 1, ShardMemory(marker_s=60), _claim(1), wait=True)
    assert done is not None
    assert await asyncio.wait_for(done, 10) == 1  # (not after the 60 s linger)


async def test_claims_alone_leave_after_the_linger(
    monkeypatch: pytest.MonkeyPatch, store: RecordingStore, behind: WriteBehind
) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 0.05)
    for n in range(3):
        behind.add(n, 1, ShardMemory(marker_s=60), _claim(n), wait=False)
    await asyncio.wait_for(behind.flush(), 10)
    assert [len(t) for t in store.transactions] == [3]


async def test_a_full_transactions_worth_leaves_without_lingering(
    monkeypatch: pytest.MonkeyPatch, store: RecordingStore, behind: WriteBehind
) -> None:
    monkeypatch.setattr(writeback, "LINGER_S", 60.0)
    behind.add(0, 1, ShardMemory(marker_s=60), _claim(0), wait=False)
    for _ in range(5):
        await asyncio.sleep(0)
    for n in range(1, writeback.MAX_OPS):
        behind.add(n, 1, ShardMemory(marker_s=60), _claim(n), wait=False)
    await asyncio.wait_for(behind.flush(), 10)
    assert sum(len(t) for t in store.transactions) == writeback.MAX_OPS

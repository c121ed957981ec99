"""An Attach stream's inbox (controlplane.server.inbox): requests in order, wake-ups
between them, the stream's end and its error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from controlplane.server.inbox import WAKE, Inbox


async def _requests(
    items: list[int], fail: bool = False, gate: asyncio.Event | None = None
) -> AsyncIterator[int]:
    for i in items:
        yield i
    if gate is not None:
        await gate.wait()
    if fail:
        raise ValueError("the stream broke")


async def test_requests_come_in_order_then_the_end() -> None:
    inbox = Inbox(_requests([1, 2, 3]))
    assert [await inbox.get() for _ in range(4)] == [1, 2, 3, None]
    await inbox.close()


async def test_a_wake_up_comes_between_requests_once() -> None:
    gate = asyncio.Event()
    inbox = Inbox(_requests([1], gate=gate))
    assert await inbox.get() == 1
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.wake()
    inbox.wake()
    assert await asyncio.wait_for(waiting, 5) is WAKE
    gate.set()
    assert await asyncio.wait_for(inbox.get(), 5) is None  # (the two wake-ups were one)
    await inbox.close()


async def test_the_streams_error_is_raised() -> None:
    inbox = Inbox(_requests([7], fail=True))
    assert await inbox.get() == 7
    with pytest.raises(ValueError, match="the stream broke"):
        await asyncio.wait_for(inbox.get(), 5)
    await inbox.close()

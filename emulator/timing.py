"""The timing model's steps: how long the emulated GPU and NIXL work takes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def modeled(ms: float) -> AsyncIterator[None]:
    """A step of the timing model: lasts ``ms`` milliseconds, timed from entry, and at least
    as long as the body (the emulator's own work for the step, which thus costs nothing
    extra while it fits in the modeled time). An exception ends it at once."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    # (not done.set_result itself: a timer already due when the body failed still runs
    # after the cancel below, and would find the future cancelled)
    timer = loop.call_later(ms / 1000, _finish, done)
    try:
        yield
        await done
    finally:
        timer.cancel()
        done.cancel()


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)

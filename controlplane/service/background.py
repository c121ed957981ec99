"""Work a daemon replica finishes for callers that went away: claims put back after a
lookup's caller left, nodes suspended after their Attach stream ended. A stop waits for
it (`settle`) before the store closes under it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    """The futures and tasks a stop must wait for."""

    def __init__(self) -> None:
        self._pending: set[asyncio.Future[Any]] = set()

    @property
    def idle(self) -> bool:
        """Nothing is left to finish."""
        return not self._pending

    def track(self, future: asyncio.Future[Any]) -> None:
        """Wait for `future` at the next `settle` (it is forgotten once done)."""
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run `work` in a task of its own, tracked. -> the task."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self.track(task)
        return task

    async def settle(self) -> None:
        """Until everything tracked is done, including what it tracks meanwhile (a claim
        that ends makes its put-back)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

"""An Attach stream's requests, merged with wake-ups from the daemon itself: a release
waiting for the node's sidecar (controlplane.service.budgets) is sent at once, not with
the answer to its next heartbeat.

The requests are read by a task of their own, at most one ahead of the handler (the
sidecar's messages are not buffered here beyond that: gRPC's flow control holds them).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Wake:
    """Returned by `Inbox.get` when something woke the handler (no request)."""


class _End:
    pass


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


WAKE = Wake()
_END = _End()


class Inbox(Generic[T]):
    """The requests of one stream, and its wake-ups, in one place to wait on."""

    def __init__(self, requests: AsyncIterator[T]) -> None:
        self._items: collections.deque[T | _End | _Failed] = collections.deque()
        self._ready = asyncio.Event()
        self._drained = asyncio.Event()
        self._woken = False
        self._task = asyncio.ensure_future(self._pump(requests))

    async def _pump(self, requests: AsyncIterator[T]) -> None:
        try:
            async for msg in requests:
                self._drained.clear()
                self._items.append(msg)
                self._ready.set()
                await self._drained.wait()  # (one ahead at most)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream's own error: the handler raises it
            self._items.append(_Failed(e))
        else:
            self._items.append(_END)
        self._ready.set()

    def wake(self) -> None:
        """Have the handler's `get` return WAKE (once for any number of calls meanwhile)."""
        self._woken = True
        self._ready.set()

    async def get(self) -> T | Wake | None:
        """The next request, WAKE, or None at the stream's end; raises the stream's error."""
        while True:
            if self._woken:
                self._woken = False
                return WAKE
            if self._items:
                item = self._items.popleft()
                if not self._items:
                    self._drained.set()
                if isinstance(item, _End):
                    return None
                if isinstance(item, _Failed):
                    raise item.error
                return item
            self._ready.clear()
            await self._ready.wait()

    async def close(self) -> None:
        """Stop reading the requests."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

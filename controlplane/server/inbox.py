"""An Attach stream's requests, merged with wake-ups from the daemon itself: a release
waiting for the node's sidecar (controlplane.service.budgets) is sent at once, not with
the answer to its next heartbeat.

The requests are read by a task of their own, at most one ahead of the handler (the
sidecar's messages are not buffered here beyond that: gRPC's flow control holds them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def close_requests(requests: AsyncIterator[Any]) -> None:
    """Close a stream's request iterator left before its end: gRPC's receiver keeps the
    last request it read in a reference cycle of its own until it is closed (freed by a
    full garbage collection only: 4 MiB per refused Attach, tests/fuzz/test_grpc.py)."""
    aclose = getattr(aiter(requests), "aclose", None)  # (gRPC's: the generator it iterates)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


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
        self._task: asyncio.Future[None] | None = asyncio.ensure_future(self._pump(requests))

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
        finally:
            await close_requests(requests)
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
        """Stop reading the requests.

        The cancelled reader's error keeps its frame, and with it this Inbox and the last
        request read: with the Inbox's own reference to the task, a cycle only a full
        garbage collection frees. Dropping the reference here (and the reader closing the
        requests, `close_requests`) frees them when the call ends."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._items.clear()

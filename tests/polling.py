"""Waiting in tests for something that happens in the background."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], within: float = 5.0, interval: float = 0.02
) -> None:
    """Poll until `predicate` (a plain or an async one) holds; fail (TimeoutError) after
    `within` seconds."""
    async with asyncio.timeout(within):
        while True:
            held = predicate()
            if await held if inspect.isawaitable(held) else held:
                return
            await asyncio.sleep(interval)

"""Waiting in tests for something that happens in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], Awaitable[bool]], within: float = 5.0, interval: float = 0.02
) -> None:
    """Poll until `predicate` holds; fail (TimeoutError) after `within` seconds."""
    async with asyncio.timeout(within):
        while True:
            if await predicate():
                return
            await asyncio.sleep(interval)

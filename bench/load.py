"""Load generation for the benchmarks that drive a daemon: closed loops (N workers, each
sending as soon as its last request is answered), open loops (requests leave on schedule,
answered or not), and percentiles in milliseconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile of seconds, in milliseconds."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1e3


async def closed_loop(n: int, concurrency: int, op: Callable[[int], Awaitable[None]]) -> float:
    """Run op(0..n-1) with `concurrency` workers. -> seconds."""
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def open_loop(
    rate: float, seconds: float, op: Callable[[int], Awaitable[None]]
) -> tuple[list[float], list[float], float]:
    """Issue op(i) at `rate`/s for `seconds`, never waiting for answers.

    -> (latencies from the actual send, latencies from the scheduled send, achieved/s).
    The first is the daemon's answer time. The second adds this generator's own lag
    (timers fire up to ~1 ms late, and later when the cores are busy): what a client
    sending on schedule would see, a request that left late included.
    """
    n = int(rate * seconds)
    lat: list[float] = []
    lat_scheduled: list[float] = []
    clock = time.perf_counter  # (uvloop's loop.time() counts whole milliseconds)
    start = clock() + 0.05

    async def one(i: int, at: float) -> None:
        sent = clock()
        await op(i)
        done = clock()
        lat.append(done - sent)
        lat_scheduled.append(done - at)

    tasks = []
    for i in range(n):
        at = start + i / rate
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.gather(*tasks)
    return lat, lat_scheduled, n / (clock() - start)

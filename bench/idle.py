"""What this machine charges for idleness: the same work at once, and after a pause.

On some virtual machines the first touch of each memory page after a few tens of
milliseconds idle costs microseconds instead of a tenth of one (measured on this
project's 2-core Firecracker guest: 0.09 us per 4 KiB page back to back, 2-4.5 us
after 100 ms; keeping the CPUs busy or using huge pages did not help). A request
path touches thousands of pages, so every latency the other benches take after an
idle gap carries it: a turn's decode hop after the prefill's model sleep, a lookup
at 100/s, the first request of a path. Run this before trusting a latency figure.

    python -m bench.idle [--pages 5000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import statistics
import time
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from kvferry.tasks import run_main

GAPS_S = (0.0, 0.01, 0.05, 0.1, 0.2)
PAGE = 4096


def touch_pages(pages: int, repeats: int) -> list[float]:
    """Median microseconds per page to read one byte of each of `pages` pages, per gap."""
    m = mmap.mmap(-1, pages * PAGE)
    for i in range(pages):
        m[i * PAGE] = 1  # resident before the first measurement
    out = []
    for gap in GAPS_S:
        xs = []
        for _ in range(repeats):
            time.sleep(gap)
            t0 = time.perf_counter()
            total = 0
            for i in range(0, pages * PAGE, PAGE):
                total += m[i]
            xs.append((time.perf_counter() - t0) * 1e6 / pages)
        out.append(statistics.median(xs[2:]))
    m.close()
    return out


async def http_hops(repeats: int) -> list[float]:
    """Median ms of a loopback HTTP request (32 KB up, 3 KB down) to this process, per gap."""

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"x" * 3000, content_type="application/json")

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    body = b"y" * 32_000
    out = []
    try:
        async with aiohttp.ClientSession() as http:
            for gap in GAPS_S:
                xs = []
                for _ in range(repeats):
                    await asyncio.sleep(gap)
                    t0 = time.perf_counter()
                    async with http.post(f"http://127.0.0.1:{port}/", data=body) as r:
                        await r.read()
                    xs.append((time.perf_counter() - t0) * 1e3)
                out.append(statistics.median(xs[2:]))
    finally:
        await runner.cleanup()
    return out


async def main_async(args: argparse.Namespace) -> int:
    pages = touch_pages(args.pages, args.repeats)
    hops = await http_hops(args.repeats)
    print(f"idle cost on this machine (medians of {args.repeats}; the first 2 of each gap dropped)")
    print(f"  {'idle before':>11} | {'per page touched':>16} | {'loopback HTTP request':>21}")
    for gap, us, ms in zip(GAPS_S, pages, hops, strict=True):
        print(f"  {gap * 1e3:>8.0f} ms | {us:>13.2f} us | {ms:>18.2f} ms")
    after_100ms = pages[GAPS_S.index(0.1)] * args.pages / 1e3
    print(
        f"  all {args.pages:,} pages ({args.pages * PAGE / 2**20:.0f} MiB) after 100 ms idle: "
        f"{after_100ms:.1f} ms"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=5000, help="distinct pages touched per measurement")
    p.add_argument("--repeats", type=int, default=15)
    return run_main(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())

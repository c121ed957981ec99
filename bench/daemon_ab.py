"""A/B of two trees' daemons under one client, in interleaved rounds, so that a change's
effect is measured in one sitting on this noisy machine (the raw etcd transaction varies by
40% between runs here: two separate bench.daemon runs do not compare).

    git worktree add /tmp/before REV
    python -m bench.daemon_ab /tmp/before:kvferry_cli .:kvferry_cli [--retentions N] [--rounds R]

Each side is TREE:MODULE, the module that runs ``kvferry`` in that tree (``kvferry.cli``
before the command line got its own package). Per round and side: a fresh daemon on its
own embedded etcd, N retentions preloaded over a Leases/Stream, then stream lookups one
at a time (p50), stream lookups 64 in flight (and the daemon's CPU time per lookup
meanwhile, from /proc: less swayed by this machine's neighbours than a rate), unary
lookups 64 in flight, stream turns (register + lookup)
128 in flight. Prints each round and the medians with the ratio B/A.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from bench.daemon_workload import DaemonProcess, lookup, register_node, retention
from bench.load import closed_loop, pct
from bench.lookup_tail import cpu_seconds
from kvferry.leaseclient import LeaseStream
from kvferry.tasks import run_main
from kvferry.v1 import leases_pb2, leases_pb2_grpc

FIGURES = (
    "stream lookup one at a time, p50 ms",
    "stream lookups 64 in flight, /s",
    "daemon CPU per stream lookup, ms",
    "unary lookups 64 in flight, /s",
    "stream turns 128 in flight, /s",
)
CLAIMS_PER_ROUND = 8000
"""Preloaded retentions each round claims (1,000 one at a time, 4,000 + 3,000 at once)."""


@asynccontextmanager
async def daemon(side: str) -> AsyncIterator[DaemonProcess]:
    """A daemon of `side` (TREE:MODULE) on its own embedded etcd, serving."""
    tree, _, module = side.partition(":")
    d = DaemonProcess(Path(tempfile.mkdtemp()) / "etcd", tree=Path(tree), module=module)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


async def measure(side: str, retentions: int) -> tuple[float, ...]:
    """One round of one side: the FIGURES, in order."""
    async with (
        daemon(side) as d,
        grpc.aio.insecure_channel(address := f"127.0.0.1:{d.port}") as channel,
        grpc.aio.insecure_channel(address) as router_channel,  # (the router's stream: its own)
    ):
        await register_node(channel)
        sidecar, router = LeaseStream(channel), LeaseStream(router_channel)
        unary = leases_pb2_grpc.LeasesStub(channel)

        async def preload(i: int) -> None:
            await sidecar.register(retention(f"c{i}"), 30)

        await closed_loop(retentions, 256, preload)
        convs = itertools.count()

        async def stream_claim(_: int) -> None:
            assert (await router.lookup(lookup(f"c{next(convs)}"), 10)).decision == leases_pb2.PULL

        async def unary_claim(_: int) -> None:
            r = await unary.Lookup(lookup(f"c{next(convs)}"), timeout=10)
            assert r.decision == leases_pb2.PULL

        async def turn(i: int) -> None:
            await sidecar.register(retention(f"t{i}"), 30)
            await router.lookup(lookup(f"t{i}"), 10)

        lat = []
        for i in range(1000):
            t = time.perf_counter()
            await stream_claim(i)
            lat.append(time.perf_counter() - t)
        assert d.proc is not None
        cpu = cpu_seconds(d.proc.pid)
        in_flight = 4000 / await closed_loop(4000, 64, stream_claim)
        cpu = cpu_seconds(d.proc.pid) - cpu
        figures = (
            pct(lat, 50),
            in_flight,
            cpu / 4000 * 1e3,
            3000 / await closed_loop(3000, 64, unary_claim),
            5000 / await closed_loop(5000, 128, turn),
        )
        await sidecar.close()
        await router.close()
        return figures


async def run(args: argparse.Namespace) -> int:
    if args.retentions < CLAIMS_PER_ROUND:
        print(
            f"--retentions must be at least {CLAIMS_PER_ROUND:,}: each round claims that many",
            file=sys.stderr,
        )
        return 2
    sides = {"A": args.a, "B": args.b}
    rounds: dict[str, list[tuple[float, ...]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, side in sides.items():
            rounds[name].append(await measure(side, args.retentions))
            print(
                f"round {r + 1} {name} ({side}): " + ", ".join(f"{x:.2f}" for x in rounds[name][-1]),
                flush=True,
            )
    print(f"\nmedians of {args.rounds} rounds, {args.retentions:,} retentions; A = {args.a}, B = {args.b}")
    for k, figure in enumerate(FIGURES):
        a, b = (statistics.median(x[k] for x in rounds[name]) for name in "AB")
        print(f"  {figure:40s} A {a:9.2f}   B {b:9.2f}   B/A {b / a:.3f}")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="TREE:MODULE of side A (e.g. /tmp/before:kvferry_cli)")
    p.add_argument("b", help="TREE:MODULE of side B (e.g. .:kvferry_cli)")
    p.add_argument("--retentions", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    run_main(run(p.parse_args()))


if __name__ == "__main__":
    main()

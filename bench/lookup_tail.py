"""Where a Lookup+claim latency tail comes from: one offered rate, in detail.

`bench.daemon` reports p50/p99 per rate; this probe runs one rate on its own and
prints what is needed to explain a tail: the CPU each process spent per lookup
(daemon, etcd, this load generator; from /proc), the load generator's own event
loop lag (a stall there is not the daemon's), etcd's WAL fsync / backend commit /
snapshot / compaction counts over the run, and a timeline of slow lookups per 250 ms.

    python -m bench.lookup_tail [--leases 20000] [--rate 1000] [--seconds 15] [--list] [--own-core] [--framed]

``--framed`` sends the lookups over the daemon's framed stream (--stream-listen), not gRPC.
``--own-core`` leaves the daemon a core nobody else runs on (see bench.cores).
``--list`` runs ``kvferry leases ls`` over every lease meanwhile, in a process of its
own: an operator listing a large store under load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.cores import OTHERS_CORE, confined
from bench.daemon_workload import (
    DaemonProcess,
    MetricsPhase,
    daemon_stalls,
    lookup,
    metrics_page,
    register_node,
    retention,
)
from bench.load import closed_loop, pct
from controlplane.embedded import EmbeddedEtcd
from kvferry.leaseclient import LeaseStream
from kvferry.tasks import run_main
from kvferry.v1 import leases_pb2
from realvllm.process import free_port

SLOW_MS = 5.0
_ETCD_COUNTERS = (
    "etcd_disk_wal_fsync_duration_seconds",
    "etcd_disk_backend_commit_duration_seconds",
    "etcd_debugging_snap_save_total_duration_seconds",
    # etcd 3.5 compaction: the key index walk, then the store in batches of 1,000
    # revisions, a commit and a 10 ms sleep after each (milliseconds, not seconds)
    "etcd_debugging_mvcc_index_compaction_pause_duration_milliseconds",
    "etcd_debugging_mvcc_db_compaction_pause_duration_milliseconds",
    "etcd_debugging_mvcc_db_compaction_total_duration_milliseconds",
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def etcd_counters(endpoint: str) -> dict[str, float]:
    """count and sum of etcd's disk histograms."""
    text = metrics_page(endpoint)
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_count", "_sum")) and name.rsplit("_", 1)[0] in _ETCD_COUNTERS:
            out[name] = float(value)
    return out


@dataclass
class Measured:
    """What one probe run measured."""

    count: int
    """Lookups offered."""
    t0: float
    """When the first was due (perf_counter)."""
    elapsed: float
    """Seconds from then until the last was answered."""
    sent_lat: list[tuple[float, float]]
    """(sent at, seconds to its answer) of every lookup."""
    lags: list[float]
    """This process's own event-loop lag, per 1 ms tick."""
    cpu: dict[str, float]
    """CPU seconds each process spent during the lookups."""
    disk: dict[str, float]
    """etcd's disk counters over the lookups (etcd_counters)."""
    listed: int
    """Retentions `kvferry leases ls` listed meanwhile (--list)."""
    stalls: list[tuple[str, tuple[float, float, float]]]
    """The daemon's own figures over the lookups (`daemon_stalls`): (what, (count, sum, over SLOW_MS))."""


class LoopLag:
    """This process's own event-loop lag, sampled by a task sleeping 1 ms at a time."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._ticking = True
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while self._ticking:
            t = loop.time()
            await asyncio.sleep(0.001)
            self.lags.append(loop.time() - t - 0.001)

    async def stop(self) -> list[float]:
        """Stop sampling (after the current tick). -> the lags."""
        self._ticking = False
        await self._task
        return self.lags


async def probe(args: argparse.Namespace) -> None:
    """Run the probe on a daemon of its own on an etcd of its own; print what it found."""
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-tail-"))
    etcd = EmbeddedEtcd(tmp / "etcd", free_port(), free_port())
    await etcd.start()
    d = DaemonProcess(etcd=etcd.endpoint)
    try:
        await d.start()
        measured = await _measure(d, etcd, tmp, args)
    finally:
        await d.stop()
        await etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _report(measured, args)


async def _measure(d: DaemonProcess, etcd: EmbeddedEtcd, tmp: Path, args: argparse.Namespace) -> Measured:
    """Preload, then offer lookups at args.rate for args.seconds (with `kvferry leases ls`
    meanwhile if args.list), measuring CPU, loop lag and etcd's disk."""
    assert d.proc is not None and etcd.pid
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{d.port}")
    await register_node(ch)
    sidecar, router = LeaseStream(ch), d.lease_stream(args.framed)
    count = int(args.rate * args.seconds)
    n = args.leases + count

    async def register(i: int) -> None:
        await sidecar.register(retention(f"c{i}"), 30)

    secs = await closed_loop(n, 256, register)
    print(f"preloaded {n:,} leases in {secs:.1f}s; offering {args.rate}/s for {args.seconds}s", flush=True)
    await asyncio.sleep(2)

    pids = {"daemon": d.proc.pid, "etcd": etcd.pid, "load generator": os.getpid()}
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    disk0 = etcd_counters(etcd.endpoint)
    daemon_page = MetricsPhase(d.metrics_address)
    lag = LoopLag()
    listed_to = tmp / "leases.jsonl"
    listing = await _start_listing(d.port, listed_to) if args.list else None
    with confined([os.getpid(), etcd.pid] if args.own_core else [], {OTHERS_CORE}):
        t0 = time.perf_counter()
        sent_lat = await _offer(router, args.rate, count)
        elapsed = time.perf_counter() - t0
    lags = await lag.stop()
    cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    disk = {k: v - disk0.get(k, 0.0) for k, v in etcd_counters(etcd.endpoint).items()}
    listed = 0
    if listing is not None:  # what it listed while the lookups ran
        listed = listed_to.read_bytes().count(b"\n")
        if listing.returncode is None:
            listing.kill()
        await listing.wait()
    await sidecar.close()
    await router.close()
    await ch.close(None)
    daemon_page.end()
    gained = daemon_stalls(daemon_page, SLOW_MS / 1e3)
    return Measured(count, t0, elapsed, sent_lat, lags, cpu, disk, listed, gained)


async def _start_listing(port: int, listed_to: Path) -> asyncio.subprocess.Process:
    """`kvferry leases ls` of everything, from its own process, into `listed_to`."""
    with listed_to.open("wb") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvferry_cli", "leases", "ls", "--daemon", f"127.0.0.1:{port}",
            "--tenant", "bench", "--json", stdout=sink,
        )  # fmt: skip


async def _offer(router: LeaseStream, rate: float, count: int) -> list[tuple[float, float]]:
    """`count` lookup+claims offered at `rate`/s (open loop), each of another preloaded
    retention. -> (sent at, seconds to its answer) of each."""
    loop = asyncio.get_running_loop()
    convs = itertools.count()
    sent_lat: list[tuple[float, float]] = []

    async def one() -> None:
        sent = time.perf_counter()
        r = await router.lookup(lookup(f"c{next(convs)}"), 10)
        assert r.decision == leases_pb2.PULL, r
        sent_lat.append((sent, time.perf_counter() - sent))

    start = loop.time() + 0.05
    tasks = []
    for i in range(count):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return sent_lat


def _report(m: Measured, args: argparse.Namespace) -> None:
    """Print the latencies, CPU per lookup, loop lag, etcd's disk, and the slow lookups'
    timeline."""
    lat = [x for _, x in m.sent_lat]
    print(
        f"\nLookup+claim @ {args.rate:g}/s for {args.seconds:g}s: p50 {pct(lat, 50):.2f}"
        f"  p90 {pct(lat, 90):.2f}  p99 {pct(lat, 99):.2f}  p99.9 {pct(lat, 99.9):.2f}"
        f"  max {max(lat) * 1e3:.1f} ms"
    )
    print(
        "CPU per lookup: "
        + ", ".join(f"{k} {v / m.count * 1e3:.3f} ms ({v / m.elapsed:.2f} core)" for k, v in m.cpu.items())
    )
    print(f"load generator loop lag: p99 {pct(m.lags, 99):.1f} ms, max {max(m.lags) * 1e3:.1f} ms")
    print(
        "daemon: "
        + "; ".join(f"{what} {n:,.0f}, {slow:,.0f} over {SLOW_MS:g} ms" for what, (n, _, slow) in m.stalls)
    )
    if args.list:
        print(f"kvferry leases ls meanwhile: {m.listed:,} leases listed while the lookups ran")
    for name in _ETCD_COUNTERS:
        c, s = m.disk.get(f"{name}_count", 0.0), m.disk.get(f"{name}_sum", 0.0)
        mean_ms = (s if name.endswith("_milliseconds") else s * 1e3) / c if c else 0.0
        print(f"etcd {name.removeprefix('etcd_')}: {c:.0f} in the run, mean {mean_ms:.2f} ms")
    buckets: dict[int, list[float]] = {}
    for sent, x in m.sent_lat:
        buckets.setdefault(int((sent - m.t0) / 0.25), []).append(x * 1e3)
    print(f"slow lookups (> {SLOW_MS:g} ms) per 250 ms, as start s: count/max ms ('.' = none):")
    marks = []
    for b in sorted(buckets):
        slow = [x for x in buckets[b] if x > SLOW_MS]
        marks.append(f"{b * 0.25:.2f}:{len(slow)}/{max(slow):.0f}" if slow else ".")
    print(" ".join(marks))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lookup_tail", description=__doc__.split("\n\n")[0])
    p.add_argument("--leases", type=int, default=20_000, help="live leases besides the ones looked up")
    p.add_argument("--rate", type=float, default=1000.0, help="lookups offered per second")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--list", action="store_true", help="run `kvferry leases ls` of everything meanwhile")
    p.add_argument("--framed", action="store_true", help="look up over --stream-listen, not gRPC")
    p.add_argument(
        "--own-core",
        action="store_true",
        help="keep this process and etcd on core 0 while lookups are offered (bench.cores)",
    )
    args = p.parse_args(argv)

    async def run() -> int:
        await probe(args)
        return 0

    return run_main(run())


if __name__ == "__main__":
    sys.exit(main())

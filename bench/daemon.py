"""Daemon benchmark: registrations, lookup+claim latency under offered load, turns/s,
etcd requests per turn, GC lease grants, restart to serving — with 100,000 live retentions.

Runs the real `kvferry daemon` (embedded etcd, its own process) and drives it over
gRPC from this process. Offered-load phases are open loop: requests leave on
schedule whether or not earlier ones were answered. Prints one table; all
ratios come from this one run.

    python -m bench.daemon [--leases 100000] [--phase-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from aetcd import rpc

from bench.daemon_claims import (
    RATES,
    TARGET_P99_MS,
    Clients,
    Rows,
    claim_phases,
    no_work_floors,
    own_core_phases,
    raw_claims,
)
from bench.daemon_workload import TOKENS, DaemonProcess, lookup, register_node, retention
from bench.load import closed_loop, pct
from bench.lookup_tail import cpu_seconds
from controlplane.embedded import EmbeddedEtcd
from controlplane.etcd import Client as _Client
from kvferry.tasks import run_main
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from realvllm.process import free_port


def _du(path: Path) -> str:
    return f"{sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 2**20:,.0f} MiB"


async def _preload(
    d: DaemonProcess, clients: Clients, args: argparse.Namespace, rows: Rows
) -> tuple[int, int, list[float]]:
    """1. Preload over the sidecar stream, then some over unary calls; GC grants per 10k
    registrations early and late. -> (retentions preloaded over the stream, over unary
    calls, the GC grants counted at every 10,000th registration)."""
    consumed = int((2 * sum(RATES) + sum(TARGET_P99_MS)) * args.phase_s) + 2000 + 2 * args.claims
    n = args.leases + consumed  # so that >= --leases stay live throughout
    grants_at: list[float] = []

    async def register(i: int) -> None:
        await clients.sidecar.register(retention(f"c{i}"), 30)
        if i % 10_000 == 0:
            grants_at.append(d.metrics().get("gc_grants", 0))

    secs = await closed_loop(n, 256, register)
    rows.append(
        ("Register, Leases/Stream (256 in flight)", f"{n / secs:,.0f} /s", f"{n:,} leases in {secs:.1f}s")
    )
    print(f"preloaded {n} leases in {secs:.1f}s", file=sys.stderr)
    extra = 5000

    async def register_unary(i: int) -> None:
        await clients.unary.Register(retention(f"u{i}"), timeout=30)

    secs = await closed_loop(extra, 64, register_unary)
    rows.append(("Register, unary (64 in flight)", f"{extra / secs:,.0f} /s", "grpcurl-style calls"))
    return n, extra, grants_at


SETTLED_CORES = 0.1
"""etcd and the daemon are settled once they use less than this many cores together."""


async def _settle(pids: list[int], rows: Rows, most_s: float = 120.0) -> None:
    """Wait until etcd and the daemon have digested the preload (etcd compacts, snapshots
    and commits its backend for a while after 200,000 writes, on the cores the phases
    share): the latency phases, and the floor they are compared with, then measure a
    steady state, not the preload's wake. How long it took is a row of its own."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < most_s:
        before = sum(cpu_seconds(p) for p in pids)
        await asyncio.sleep(1.0)
        if sum(cpu_seconds(p) for p in pids) - before < SETTLED_CORES:
            break
    waited = time.perf_counter() - t0
    settled = "settled" if waited < most_s else "not settled, went on"
    rows.append(
        ("etcd + daemon idle after the preload", f"{waited:.0f} s", f"{settled} (< {SETTLED_CORES} cores)")
    )


async def _raw_etcd(endpoint: str, phase_s: float, rows: Rows) -> float:
    """2. Raw aetcd transaction latency, same shape as a claim, from this process straight
    to etcd: one at a time (the ratio's base), and at 1,000/s, one transaction each (what
    etcd and an aetcd client give a claim at that rate here, with no daemon; the daemon
    adds its gRPC hop and may group claims into fewer transactions). -> the sequential p50."""
    raw = _Client((endpoint,), 5.0)
    await raw.connect()
    raw_lat = await raw_claims(raw, "seq", 2000)
    raw_p50 = pct(raw_lat, 50)
    rows.append(
        ("raw aetcd claim txn p50 / p99 (sequential)", f"{raw_p50:.2f} / {pct(raw_lat, 99):.2f} ms", "")
    )
    raw_lat = await raw_claims(raw, "rate", int(1000 * phase_s), rate=1000)
    await raw.kvstub.DeleteRange(rpc.DeleteRangeRequest(key=b"/bench-raw/", range_end=b"/bench-raw0"))
    rows.append(
        (
            "raw aetcd claim txn @ 1000/s: p50 / p99",
            f"{pct(raw_lat, 50):.2f} / {pct(raw_lat, 99):.2f} ms",
            "no daemon: this process straight to etcd, one txn each",
        )
    )
    await raw.close()
    return raw_p50


async def _turns(d: DaemonProcess, clients: Clients, turns_on_stream: int, rows: Rows) -> None:
    """4. Turns: a finished turn registers (sidecar), the next one looks it up (router);
    on the streams, then (a third as many) on unary calls."""
    for path in ("stream", "unary"):
        before = d.metrics()
        t_start = time.perf_counter()
        turns = turns_on_stream if path == "stream" else turns_on_stream // 3

        async def turn(i: int, path: str = path) -> None:
            conv = f"t{path}{i}"
            if path == "stream":
                await clients.sidecar.register(retention(conv), 10)
                r = await clients.router.lookup(lookup(conv), 10)
            else:
                await clients.unary.Register(retention(conv), timeout=10)
                r = await clients.unary.Lookup(lookup(conv), timeout=10)
            assert r.decision == leases_pb2.PULL, r

        secs = await closed_loop(turns, 128, turn)
        after = d.metrics()
        minutes = (time.perf_counter() - t_start) / 60
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        rows.append(
            (
                f"Turns, {path} (register + lookup+claim, 128 in flight)",
                f"{turns / secs:,.0f} /s",
                f"{turns:,} turns in {secs:.1f}s",
            )
        )
        if path == "stream":
            _etcd_rows(delta, turns, minutes, rows)


def _etcd_rows(delta: dict[str, float], turns: int, minutes: float, rows: Rows) -> None:
    """etcd requests and GC lease grants per turn, from the daemon's metrics' `delta`."""
    etcd_requests = sum(v for k, v in delta.items() if k not in ("gc_grants", "load_nodes", "batched_txns"))
    writes = delta.get("put_retention", 0) + delta.get("claim", 0) + delta.get("txn_batch", 0)
    writes += delta.get("lease_grant", 0) + delta.get("owner_write", 0)  # (the owners' write-behind)
    rows.append(
        (
            "etcd requests per turn",
            f"{etcd_requests / turns:.3f}",
            f"writes {writes / turns:.3f} (group commit; "
            f"{delta.get('batched_txns', 0) / turns:.2f} write transactions before grouping); "
            f"node refreshes {delta.get('load_nodes', 0):.0f} in all",
        )
    )
    rows.append(
        (
            "GC lease grants during turns",
            f"{delta.get('gc_grants', 0) / minutes:.1f} /min",
            f"{delta.get('gc_grants', 0):.0f} grants",
        )
    )


def _grant_rows(grants_at: list[float], rows: Rows) -> None:
    """GC lease grants over the first and the last 10,000 registrations of the preload."""
    if len(grants_at) >= 3:
        early = grants_at[1] - grants_at[0]
        late = grants_at[-1] - grants_at[-2]
        rows.append(
            (
                "GC grants per 10k registrations, first vs last 10k",
                f"{early:.0f} vs {late:.0f}",
                f"from 0 vs from {(len(grants_at) - 2) * 10_000:,} live",
            )
        )


async def _restart_external(
    d: DaemonProcess, clients: Clients, start_s: float, n: int, left: int, rows: Rows
) -> None:
    """5. Restart to serving, with the retentions in the external etcd; then a preloaded
    retention looked up."""
    await clients.close()
    restart_s = await d.restart()
    rows.append(
        ("daemon start to serving (external etcd)", f"{start_s:.2f} s", "exec to first Lookup answered")
    )
    rows.append(
        (
            f"daemon restart to serving ({left:,} leases)",
            f"{restart_s:.2f} s",
            "SIGTERM, exec, first Lookup answered",
        )
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch2:
        r = await leases_pb2_grpc.LeasesStub(ch2).Lookup(lookup(f"c{n - 1}"), timeout=5)
        rows.append(("a preloaded lease after restart", leases_pb2.Decision.Name(r.decision), r.reason))


async def _restart_embedded(d: DaemonProcess, etcd_data: Path, left: int, rows: Rows) -> None:
    """The laptop default: `d`, the daemon with its embedded etcd on `etcd_data`, started
    on the data, then restarted. One sample swings by a second here (page cache, a
    compaction etcd resumes), so three."""
    first_start = await d.start()
    restarts = [await d.restart() for _ in range(3)]
    rows.append(
        (
            f"embedded: daemon + etcd restart ({left:,} leases)",
            f"{statistics.median(restarts):.2f} s",
            "SIGTERM to first Lookup answered, median of "
            + ", ".join(f"{r:.2f}" for r in restarts)
            + f"; a start on the data {first_start:.2f} s; etcd data {_du(etcd_data)}",
        )
    )


async def bench(args: argparse.Namespace) -> None:
    """Run every phase against one daemon (and its restarts); print the table."""
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-bench-"))
    # etcd in a process of its own (as in production), so the daemon can restart alone.
    etcd = EmbeddedEtcd(tmp / "etcd", free_port(), free_port())
    await etcd.start()
    tree = Path(args.tree) if args.tree else None
    d = DaemonProcess(etcd=etcd.endpoint, tree=tree)
    start_s = await d.start()
    rows: Rows = []
    # (the sidecar's and the router's path: one Leases/Stream each; the router's framed too)
    clients = Clients.connect(d.port, d.stream_port if tree is None else 0)
    await register_node(clients.channel)
    try:
        n, extra, grants_at = await _preload(d, clients, args, rows)
        assert d.proc is not None
        await _settle([etcd.pid, d.proc.pid], rows)
        raw_p50 = await _raw_etcd(etcd.endpoint, args.phase_s, rows)
        floors = await no_work_floors(clients, args.phase_s, rows)
        await claim_phases(clients, args, raw_p50, rows, floors)
        await own_core_phases(clients, etcd.pid, args, raw_p50, rows)
        await _turns(d, clients, args.turns, rows)
        _grant_rows(grants_at, rows)
        left = n - next(clients.convs) + extra
        rows.append(("live leases at the end", f"{left:,}", "(+ claim markers)"))
        await _restart_external(d, clients, start_s, n, left, rows)
        await d.stop()
        await etcd.stop()
        d = DaemonProcess(etcd.data_dir, tree=tree)
        await _restart_embedded(d, etcd.data_dir, left, rows)
    finally:
        await d.stop()
        await etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # ~1.7 GiB of etcd data
    width = max(len(r[0]) for r in rows)
    print(
        f"\nkvferry daemon benchmark — {os.cpu_count()} cores, "
        f"{args.leases:,}+ live leases of {TOKENS} tokens"
    )
    for name, value, note in rows:
        print(f"  {name.ljust(width)}  {value:>16}  {note}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--leases", type=int, default=100_000)
    p.add_argument("--phase-s", type=float, default=10.0)
    p.add_argument("--turns", type=int, default=30_000)
    p.add_argument("--claims", type=int, default=20_000, help="lookups in each max-rate phase")
    p.add_argument("--tree", default="", help="run the daemon of this checkout (default: this one)")
    args = p.parse_args()

    async def run() -> int:
        await bench(args)
        return 0

    run_main(run())  # uvloop, like the daemon: the load generator shares these 2 cores


if __name__ == "__main__":
    main()

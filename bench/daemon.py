"""Daemon benchmark: registrations, lookup+claim latency under offered load, turns/s,
etcd requests per turn, GC lease grants, restart to serving — with 100,000 live leases.

Runs the real `kvferry daemon` (embedded etcd, its own process) and drives it over
gRPC from this process. Offered-load phases are open loop: requests leave on
schedule whether or not earlier ones were answered. Prints one table; all
ratios come from this one run.

    python -m bench.daemon [--leases 100000] [--phase-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from aetcd import rpc

from controlplane.embedded import EmbeddedEtcd
from controlplane.etcd import Client as _Client
from kvferry.digests import block_digests, seed
from kvferry.leaseclient import LeaseStream
from kvferry.structs import dict_to_struct
from kvferry.tasks import run_main
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc

BLOCK = 16
TOKENS = 2048  # per conversation: 128 blocks of ids and digests (~3.7 KB per record)
SEED = seed("bench-model")
DIGESTS = block_digests(list(range(TOKENS)), BLOCK, SEED)
PROMPT_DIGESTS = block_digests(list(range(TOKENS + 300)), BLOCK, SEED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ignore_index(op: Callable[[], Awaitable[None]], _: int) -> None:
    await op()


def _du(path: Path) -> str:
    return f"{sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 2**20:,.0f} MiB"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1e3


def lease(conv: str) -> leases_pb2.RegisterLeaseRequest:
    req = leases_pb2.RegisterLeaseRequest(
        tenant="bench",
        conversation_id=conv,
        engine_id="d-0",
        num_tokens=TOKENS,
        block_size=BLOCK,
        block_digests=DIGESTS,
    )
    dict_to_struct(
        {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [list(range(1000, 1000 + TOKENS // BLOCK))],
            "remote_engine_id": "d-0",
            "remote_request_id": f"chatcmpl-{conv}",
            "remote_host": "10.0.0.7",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": TOKENS,
        },
        req.kv_transfer_params,
    )  # as the sidecar builds it
    return req


async def register_node(channel: grpc.aio.Channel) -> None:
    """The decode node every benchmark lease is registered under."""
    await nodes_pb2_grpc.NodesStub(channel).Register(
        nodes_pb2.RegisterNodeRequest(
            engine_id="d-0", role=nodes_pb2.DECODE, model="bench-model", block_size=BLOCK,
            http_url="http://127.0.0.1:1", side_channel_host="10.0.0.7", side_channel_port=5600,
            liveness_ttl_seconds=3600,
        )
    )  # fmt: skip


def lookup(conv: str) -> leases_pb2.LookupRequest:
    return leases_pb2.LookupRequest(
        tenant="bench", conversation_id=conv, prompt_tokens=TOKENS + 300, prompt_digests=PROMPT_DIGESTS
    )


class DaemonProcess:
    """`kvferry daemon` in its own process: on an external etcd, or embedded (etcd=None)."""

    def __init__(self, data_dir: Path, etcd: str | None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.etcd_port = free_port()
        self.data_dir = data_dir
        self.etcd = etcd
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> float:
        """Start and wait until a Lookup is answered. -> seconds from exec to serving."""
        t0 = time.perf_counter()
        store = (
            ["--etcd", self.etcd]
            if self.etcd
            else ["--data-dir", str(self.data_dir), "--embedded-port", str(self.etcd_port)]
        )
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvferry_cli", "--log-level", "warning", "daemon",
            "--listen", f"127.0.0.1:{self.port}", "--metrics-port", str(self.metrics_port), *store,
            stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        fast_retry = [
            ("grpc.initial_reconnect_backoff_ms", 20),
            ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 50),
        ]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}", options=fast_retry) as ch:
            stub = leases_pb2_grpc.LeasesStub(ch)
            while True:
                try:
                    r = await stub.Lookup(lookup("probe"), timeout=1, wait_for_ready=True)
                    if r.reason != "store_unavailable":
                        return time.perf_counter() - t0
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.01)

    async def restart(self) -> float:
        """Stop (SIGTERM, if running) and start again. -> seconds from SIGTERM to serving."""
        t0 = time.perf_counter()
        await self.stop()
        await self.start()
        return time.perf_counter() - t0

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await self.proc.wait()

    def metrics(self) -> dict[str, float]:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r'kvferry_etcd_seconds_count\{op="(\w+)"\} (\S+)', line)
            if m:
                out[m.group(1)] = float(m.group(2))
            elif line.startswith("kvferry_gc_lease_grants_total "):
                out["gc_grants"] = float(line.split()[1])
            elif line.startswith("kvferry_etcd_batch_items_sum "):
                out["batched_txns"] = float(line.split()[1])
        return out


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


async def _raw_claims(raw: _Client, name: str, n: int, rate: float = 0.0) -> list[float]:
    """Latencies of `n` claim-shaped etcd transactions (exists -> range, delete, put) on
    keys of a claim record's size: one at a time, or offered at `rate`/s (open loop)."""
    keys = [f"/bench-raw/{name}/{i}".encode() for i in range(n)]

    async def put(i: int) -> None:
        await raw.kvstub.Put(rpc.PutRequest(key=keys[i], value=b"x" * 3700))

    await closed_loop(n, 64, put)

    async def claim(i: int) -> None:
        k = keys[i]
        await raw.kvstub.Txn(
            rpc.TxnRequest(
                compare=[
                    rpc.Compare(key=k, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)
                ],
                success=[
                    rpc.RequestOp(request_range=rpc.RangeRequest(key=k)),
                    rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k)),
                    rpc.RequestOp(request_put=rpc.PutRequest(key=k + b"/c", value=b"{}")),
                ],
            ),
            timeout=5,
        )

    if rate:
        return (await open_loop(rate, n / rate, claim))[0]
    lat = []
    for i in range(n):
        t = time.perf_counter()
        await claim(i)
        lat.append(time.perf_counter() - t)
    return lat


async def bench(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-bench-"))
    # etcd in a process of its own (as in production), so the daemon can restart alone.
    etcd = EmbeddedEtcd(tmp / "etcd", free_port(), free_port())
    await etcd.start()
    d = DaemonProcess(tmp / "unused", etcd.endpoint)
    start_s = await d.start()
    rows: list[tuple[str, str, str]] = []
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{d.port}")
    unary = leases_pb2_grpc.LeasesStub(ch)
    # The sidecar's and the router's path: one Leases/Stream each.
    sidecar, router = LeaseStream(ch), LeaseStream(grpc.aio.insecure_channel(f"127.0.0.1:{d.port}"))
    await register_node(ch)
    convs = itertools.count()  # every lookup below claims a different preloaded lease

    async def claim_unary() -> None:
        r = await unary.Lookup(lookup(f"c{next(convs)}"), timeout=10)
        assert r.decision == leases_pb2.PULL, r

    async def claim_stream() -> None:
        r = await router.lookup(lookup(f"c{next(convs)}"), 10)
        assert r.decision == leases_pb2.PULL, r

    try:
        # 1. Preload over the sidecar stream; GC grants per 10k registrations early and late.
        consumed = int(2 * 1600 * args.phase_s) + 2000 + 2 * args.claims
        n = args.leases + consumed  # so that >= --leases stay live throughout
        grants_at: list[float] = []

        async def register(i: int) -> None:
            await sidecar.register(lease(f"c{i}"), 30)
            if i % 10_000 == 0:
                grants_at.append(d.metrics().get("gc_grants", 0))

        secs = await closed_loop(n, 256, register)
        rows.append(
            ("Register, Leases/Stream (256 in flight)", f"{n / secs:,.0f} /s", f"{n:,} leases in {secs:.1f}s")
        )
        print(f"preloaded {n} leases in {secs:.1f}s", file=sys.stderr)
        extra = 5000

        async def register_unary(i: int) -> None:
            await unary.Register(lease(f"u{i}"), timeout=30)

        secs = await closed_loop(extra, 64, register_unary)
        rows.append(("Register, unary (64 in flight)", f"{extra / secs:,.0f} /s", "grpcurl-style calls"))

        # 2. Raw aetcd transaction latency, same shape as a claim, from this process straight
        # to etcd: one at a time (the ratio's base), and at 1,000/s, one transaction each
        # (what etcd and an aetcd client give a claim at that rate here, with no daemon;
        # the daemon adds its gRPC hop and may group claims into fewer transactions).
        raw = _Client((etcd.endpoint,), 5.0)
        await raw.connect()
        raw_lat = await _raw_claims(raw, "seq", 2000)
        raw_p50 = pct(raw_lat, 50)
        rows.append(
            ("raw aetcd claim txn p50 / p99 (sequential)", f"{raw_p50:.2f} / {pct(raw_lat, 99):.2f} ms", "")
        )
        raw_lat = await _raw_claims(raw, "rate", int(1000 * args.phase_s), rate=1000)
        await raw.kvstub.DeleteRange(rpc.DeleteRangeRequest(key=b"/bench-raw/", range_end=b"/bench-raw0"))
        rows.append(
            (
                "raw aetcd claim txn @ 1000/s: p50 / p99",
                f"{pct(raw_lat, 50):.2f} / {pct(raw_lat, 99):.2f} ms",
                "no daemon: this process straight to etcd, one txn each",
            )
        )
        await raw.close()

        # 3. Lookup+claim under offered load (open loop), on both paths.
        for path, claim in (("stream", claim_stream), ("unary", claim_unary)):
            for rate in (100, 500, 1000):
                seconds = args.phase_s  # (1,000 samples at 100/s: a p99 of more than a handful)
                lat, lat_scheduled, got = await open_loop(
                    rate, seconds, functools.partial(_ignore_index, claim)
                )
                rows.append(
                    (
                        f"Lookup+claim {path} @ {rate}/s: p50 / p99",
                        f"{pct(lat, 50):.2f} / {pct(lat, 99):.2f} ms",
                        f"achieved {got:,.0f}/s; p50 {pct(lat, 50) / raw_p50:.2f}x raw txn; "
                        f"from schedule {pct(lat_scheduled, 50):.2f} / {pct(lat_scheduled, 99):.2f}",
                    )
                )
            lat_seq: list[float] = []
            for _ in range(1000):
                t = time.perf_counter()
                await claim()
                lat_seq.append(time.perf_counter() - t)
            rows.append(
                (
                    f"Lookup+claim {path}, one at a time: p50",
                    f"{pct(lat_seq, 50):.2f} ms",
                    f"{pct(lat_seq, 50) / raw_p50:.2f}x raw txn p50",
                )
            )
            lat_max: list[float] = []

            async def timed_claim(
                _: int, claim: Callable[[], Awaitable[None]] = claim, lat_max: list[float] = lat_max
            ) -> None:
                t = time.perf_counter()
                await claim()
                lat_max.append(time.perf_counter() - t)

            secs = await closed_loop(args.claims, 64, timed_claim)
            rows.append(
                (
                    f"Lookup+claim {path}, max (64 in flight)",
                    f"{args.claims / secs:,.0f} /s",
                    f"p50 {pct(lat_max, 50):.2f} ms, p99 {pct(lat_max, 99):.2f} ms",
                )
            )

        # 4. Turns: a finished turn registers (sidecar), the next one looks it up (router).
        for path in ("stream", "unary"):
            before = d.metrics()
            t_start = time.perf_counter()
            turns = args.turns if path == "stream" else args.turns // 3

            async def turn(i: int, path: str = path) -> None:
                conv = f"t{path}{i}"
                if path == "stream":
                    await sidecar.register(lease(conv), 10)
                    r = await router.lookup(lookup(conv), 10)
                else:
                    await unary.Register(lease(conv), timeout=10)
                    r = await unary.Lookup(lookup(conv), timeout=10)
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
                etcd_requests = sum(
                    v for k, v in delta.items() if k not in ("gc_grants", "load_nodes", "batched_txns")
                )
                writes = delta.get("put_retention", 0) + delta.get("claim", 0) + delta.get("txn_batch", 0)
                writes += delta.get("lease_grant", 0)
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
        left = n - next(convs) + extra
        rows.append(("live leases at the end", f"{left:,}", "(+ claim markers)"))

        # 5. Restart to serving, with the leases in the embedded etcd's data dir.
        await sidecar.close()
        await router.close()
        await ch.close(None)
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
        # The laptop default: the daemon restarting with its embedded etcd on the same data.
        await d.stop()
        await etcd.stop()
        d = DaemonProcess(etcd.data_dir, None)
        # A start on the data, then restarts; one sample swings by a second here (page
        # cache, a compaction etcd resumes), so three.
        first_start = await d.start()
        restarts = [await d.restart() for _ in range(3)]
        rows.append(
            (
                f"embedded: daemon + etcd restart ({left:,} leases)",
                f"{statistics.median(restarts):.2f} s",
                "SIGTERM to first Lookup answered, median of "
                + ", ".join(f"{r:.2f}" for r in restarts)
                + f"; a start on the data {first_start:.2f} s; etcd data {_du(etcd.data_dir)}",
            )
        )
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
    args = p.parse_args()

    async def run() -> int:
        await bench(args)
        return 0

    run_main(run())  # uvloop, like the daemon: the load generator shares these 2 cores


if __name__ == "__main__":
    main()

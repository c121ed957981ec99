"""The lookup+claim phases of bench.daemon: offered load on the stream (gRPC's, and the
framed one of --stream-listen) and on unary calls (open loop), one at a time, at the most
(closed loop), the no-work floors they are compared with, and the same on the streams
with the daemon on a core of its own."""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from aetcd import rpc

from bench.cores import OTHERS_CORE, can_confine, confined
from bench.daemon_workload import lookup
from bench.load import closed_loop, open_loop, pct
from controlplane.etcd import Client as EtcdClient
from kvferry.framedstream import opener
from kvferry.leaseclient import LeaseOpError, LeaseStream
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from realvllm.process import stop_child

RATES = (100, 500, 1000, 2000)
"""Lookup+claim rates offered."""
TARGET_P99_MS = {1000: 5.0, 2000: 10.0}
"""Issue 23's targets for the stream's lookup+claim p99."""
TARGET_RATES = tuple(TARGET_P99_MS)
"""The rates with a target: the no-work floor's, and the daemon's own core's phases."""
OWN_CORE = " (daemon's own core)"
"""The suffix of the rows measured with the load generator and etcd kept off a core (`own_core_phases`)."""

Rows = list[tuple[str, str, str]]
"""The table the benchmark prints: (figure, value, note), in order."""


async def _ignore_index(op: Callable[[], Awaitable[None]], _: int) -> None:
    await op()


@dataclass
class Clients:
    """The benchmark's clients of one daemon: unary calls (grpcurl-style), the sidecar's
    Leases/Stream, and the router's on a channel of its own; `convs` numbers the claims,
    so that every lookup claims a different preloaded retention."""

    channel: grpc.aio.Channel
    unary: leases_pb2_grpc.LeasesAsyncStub
    sidecar: LeaseStream
    router: LeaseStream
    convs: itertools.count[int]
    framed: LeaseStream | None = None
    """The router's path over the daemon's framed stream (--stream-listen; None: not served)."""
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    """Lookups that got no answer, by status: past what the daemon serves, a call can be
    cancelled (the ratio is the figure; one such call used to end the benchmark)."""

    @classmethod
    def connect(cls, port: int, stream_port: int = 0) -> Clients:
        """Channels to the daemon on `port`; the router's stream has one of its own (and a
        framed one to `stream_port`, when given)."""
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        unary, sidecar = leases_pb2_grpc.LeasesStub(channel), LeaseStream(channel)
        router = LeaseStream(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        framed = LeaseStream(None, opener=opener(f"127.0.0.1:{stream_port}")) if stream_port else None
        return cls(channel, unary, sidecar, router, itertools.count(), framed)

    def streams(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """The stream paths measured: gRPC's, and the framed one when the daemon serves it."""
        framed = [("framed", self.claim_framed)] if self.framed is not None else []
        return [("stream", self.claim_stream), *framed]

    async def claim_unary(self) -> None:
        try:
            r = await self.unary.Lookup(lookup(f"c{next(self.convs)}"), timeout=10)
        except grpc.aio.AioRpcError as e:
            self.failed[e.code().name] += 1
            return
        assert r.decision == leases_pb2.PULL, r

    async def claim_stream(self, stream: LeaseStream | None = None) -> None:
        await self.claim_routed(lambda _: stream or self.router)

    async def claim_routed(self, route: Callable[[str], LeaseStream]) -> None:
        """The next conversation's lookup, on the stream `route` picks for it."""
        conv = f"c{next(self.convs)}"
        try:
            r = await route(conv).lookup(lookup(conv), 10)
        except LeaseOpError as e:
            self.failed[e.code.name] += 1
            return
        assert r.decision == leases_pb2.PULL, r

    async def claim_framed(self) -> None:
        await self.claim_stream(self.framed)

    async def close(self) -> None:
        await self.sidecar.close()
        await self.router.close()
        if self.framed is not None:
            await self.framed.close()
        await self.channel.close(None)


Floors = dict[str, dict[int, float]]
"""The no-work floor's p99 (ms) per stream path ("stream", "framed") and rate."""


async def no_work_floors(
    clients: Clients, phase_s: float, rows: Rows, confine: list[int] | None = None
) -> Floors:
    """2b. The floor of each stream path `clients` measures (`no_work_floor`)."""
    return {path: await no_work_floor(phase_s, rows, confine, path) for path, _ in clients.streams()}


async def no_work_floor(
    phase_s: float, rows: Rows, confine: list[int] | None = None, path: str = "stream"
) -> dict[int, float]:
    """The same offered lookups against bench.echo (a Leases/Stream server doing no work, in
    its own process; framed, for the "framed" path): the floor gRPC Python (or the framing)
    and this machine put under any daemon's latency. -> its p99 (ms) per rate. `confine`:
    the processes kept off the echo's core meanwhile (see `own_core_phases`; the echo is
    started before, as the daemon was)."""
    confine = confine or []
    framed = path == "framed"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.echo", "--port", "0", *(["--framed"] if framed else []),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    p99s: dict[int, float] = {}
    try:
        assert proc.stdout is not None
        port = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        if not port.isdigit():
            code = await asyncio.wait_for(proc.wait(), 10) if not port else proc.returncode
            raise RuntimeError(
                f"bench.echo did not start: it said {port!r} (exit code {code}; see its stderr)"
            )
        channel = None if framed else grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        if channel is None:
            stream = LeaseStream(None, opener=opener(f"127.0.0.1:{port}"))
        else:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stream = LeaseStream(channel)

        async def echo(_: int) -> None:
            await stream.lookup(lookup("echo"), 10)

        layout, echo_flag = OWN_CORE if confine else "", " --framed" if framed else ""
        for rate in TARGET_RATES:
            with confined(confine, {OTHERS_CORE}):
                lat, _, got = await open_loop(rate, phase_s, echo)
            p99s[rate] = pct(lat, 99)
            rows.append(
                (
                    f"floor: no-work {path} (bench.echo{echo_flag}) @ {rate}/s{layout}: p50 / p99",
                    f"{pct(lat, 50):.2f} / {p99s[rate]:.2f} ms",
                    f"achieved {got:,.0f}/s; the same client and messages, no daemon",
                )
            )
        await stream.close()
        if channel is not None:
            await channel.close(None)
    finally:
        await stop_child(proc)
    return p99s


async def claim_phases(
    clients: Clients, args: argparse.Namespace, raw_p50: float, rows: Rows, floors: Floors
) -> None:
    """3. Lookup+claim under offered load (open loop), one at a time, and at the most
    (closed loop), on every path."""
    for path, claim in (*clients.streams(), ("unary", clients.claim_unary)):
        floor = floors.get(path, {})
        await _offered_claims(path, claim, args.phase_s, raw_p50, rows, clients.failed, floor)
        await _sequential_claims(path, claim, raw_p50, rows)
        await _max_claims(path, claim, args.claims, rows)


async def _offered_claims(
    path: str,
    claim: Callable[[], Awaitable[None]],
    phase_s: float,
    raw_p50: float,
    rows: Rows,
    failed: collections.Counter[str],
    floor: dict[int, float],
    rates: tuple[int, ...] = RATES,
    layout: str = "",
) -> None:
    """Lookup+claim offered at each of `rates` for `phase_s` each (with the p99's ratio to
    the no-work floor's, on the stream, where it was measured; with the target's, where
    there is one). `layout`: the row names' suffix (see `own_core_phases`)."""
    for rate in rates:
        seconds = phase_s  # (1,000 samples at 100/s: a p99 of more than a handful)
        failed.clear()
        lat, lat_scheduled, got = await open_loop(rate, seconds, functools.partial(_ignore_index, claim))
        lost = "".join(f"; {n} {code}" for code, n in failed.items())
        if rate in floor:
            lost += f"; p99 {pct(lat, 99) / floor[rate]:.1f}x the floor's"
        if path != "unary" and rate in TARGET_P99_MS:
            lost += f", {pct(lat, 99) / TARGET_P99_MS[rate]:.2f}x the target's ({TARGET_P99_MS[rate]:g} ms)"
        rows.append(
            (
                f"Lookup+claim {path} @ {rate}/s{layout}: p50 / p99",
                f"{pct(lat, 50):.2f} / {pct(lat, 99):.2f} ms",
                f"achieved {got:,.0f}/s; p50 {pct(lat, 50) / raw_p50:.2f}x raw txn; "
                f"from schedule {pct(lat_scheduled, 50):.2f} / {pct(lat_scheduled, 99):.2f}{lost}",
            )
        )


async def own_core_phases(
    clients: Clients, etcd_pid: int, args: argparse.Namespace, raw_p50: float, rows: Rows
) -> None:
    """3b. The stream's offered phases and their floor again, with this process (the load
    generator) and etcd confined to one core and the daemon (or the echo) free to use
    every core: the daemon has a core nobody else runs on, as its CPU request gives it
    in a deployment, where routers and etcd run on machines of their own (bench.cores)."""
    if not can_confine():
        rows.append(("daemon on a core of its own", "skipped", "this machine has one core"))
        return
    others = [os.getpid(), etcd_pid]
    floors = await no_work_floors(clients, args.phase_s, rows, others)
    with confined(others, {OTHERS_CORE}):
        for path, claim in clients.streams():
            await _offered_claims(
                path,
                claim,
                args.phase_s,
                raw_p50,
                rows,
                clients.failed,
                floors[path],
                rates=TARGET_RATES,
                layout=OWN_CORE,
            )


async def _sequential_claims(
    path: str, claim: Callable[[], Awaitable[None]], raw_p50: float, rows: Rows
) -> None:
    """1,000 lookup+claims one at a time."""
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


async def _max_claims(path: str, claim: Callable[[], Awaitable[None]], claims: int, rows: Rows) -> None:
    """`claims` lookup+claims, 64 in flight."""
    lat_max: list[float] = []

    async def timed_claim(_: int) -> None:
        t = time.perf_counter()
        await claim()
        lat_max.append(time.perf_counter() - t)

    secs = await closed_loop(claims, 64, timed_claim)
    rows.append(
        (
            f"Lookup+claim {path}, max (64 in flight)",
            f"{claims / secs:,.0f} /s",
            f"p50 {pct(lat_max, 50):.2f} ms, p99 {pct(lat_max, 99):.2f} ms",
        )
    )


async def raw_claims(raw: EtcdClient, name: str, n: int, rate: float = 0.0) -> list[float]:
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

"""Sidecar benchmark: KV-event ingest engine -> sidecar -> daemon index, and the tap's
time-to-first-byte overhead on a streamed answer.

Processes as in production: the real `kvferry daemon` (embedded etcd), an
emulated engine (`kvferry emulate`) and the real `kvferry sidecar` in front of
it, each its own process. This process publishes KV events the way vLLM does
(ZMQ PUB ``[topic, seq, payload]`` with vLLM's msgpack encoding, BlockStored
events carrying their token ids, plus the replay ROUTER) as fast as it can, and
plays the HTTP client.

1. Ingest: N distinct block hashes stored, then the same N removed; the clock
   runs from the first payload published to the daemon's ``Nodes/List``
   reporting the node's ``indexed_blocks`` at the final count.
2. TTFB: one streamed chat completion at a time, interleaved: straight to the
   engine, through the sidecar untouched (no conversation), through the tap
   (a conversation: body rewritten, SSE events parsed). Time from sending the
   request to the first byte of the answer's body; medians over the run.

    python -m bench.sidecar [--hashes 1000000] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import zmq
import zmq.asyncio

from bench.load import pct
from emulator.kvevents import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    encode_batch,
    encode_seq,
)
from kvferry.tasks import run_main
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc
from realvllm.process import free_port

ENGINE_ID = "bench-d"
BLOCK = 16


def _rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def start_daemon(data_dir: Path) -> tuple[asyncio.subprocess.Process, int]:
    """`kvferry daemon` on its embedded etcd; -> (process, gRPC port) once it answers."""
    port = free_port()
    proc = await spawn(
        "--log-level", "warning", "daemon", "--listen", f"127.0.0.1:{port}", "--metrics-port", "-1",
        "--data-dir", str(data_dir), "--embedded-port", str(free_port()),
    )  # fmt: skip
    deadline = time.perf_counter() + 60
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        while True:
            try:
                await nodes_pb2_grpc.NodesStub(ch).List(nodes_pb2.ListNodesRequest(), timeout=1)
                return proc, port
            except grpc.aio.AioRpcError:
                if time.perf_counter() > deadline or proc.returncode is not None:
                    raise RuntimeError("the daemon did not start") from None
                await asyncio.sleep(0.05)


class Publisher:
    """vLLM's KV-event publisher: PUB for live batches, ROUTER answering replays from memory."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # queue rather than drop: measure the consumer
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.kept: list[tuple[bytes, bytes]] = []
        self.seq = 0
        self._replays = asyncio.create_task(self._serve_replays())

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in self.kept[first:]:  # (vLLM 0.32's shape: the topic frame, here empty)
                await self.router.send_multipart([client, b"", b"", seq, payload])
            await self.router.send_multipart([client, b"", b"", encode_seq(-1), b""])

    def publish_all(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            seq = encode_seq(self.seq)
            self.seq += 1
            self.kept.append((seq, payload))
            self.pub.send_multipart([b"", seq, payload], copy=False)

    async def close(self) -> None:
        self._replays.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replays
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def block_hash(i: int) -> int:
    """The i-th block's hash: 64 bits spread as vLLM's are (a small int is a smaller Python
    object, and would understate the index's memory per block)."""
    return (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64


def stored_payloads(first: int, n: int, per_event: int, per_batch: int) -> list[bytes]:
    """BlockStored batches of blocks first..first+n-1, with token ids like vLLM sends them."""
    tokens = list(range(BLOCK * per_event))
    out, h = [], first
    while h < first + n:
        events: list[Event] = []
        for _ in range(per_batch // per_event):
            hashes = list(range(h, min(h + per_event, first + n)))
            if not hashes:
                break
            events.append(
                BlockStored(
                    block_hashes=[block_hash(i) for i in hashes],
                    parent_block_hash=block_hash(h - 1) if h > first else None,
                    token_ids=tokens[: BLOCK * len(hashes)],
                    block_size=BLOCK,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                )
            )
            h += len(hashes)
        out.append(encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return out


def removed_payloads(first: int, n: int, per_event: int, per_batch: int) -> list[bytes]:
    out = []
    for start in range(first, first + n, per_batch):
        end = min(start + per_batch, first + n)
        events: list[Event] = [
            BlockRemoved(
                block_hashes=[block_hash(i) for i in range(s, min(s + per_event, end))], medium=MEDIUM_GPU
            )
            for s in range(start, end, per_event)
        ]
        out.append(encode_batch(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return out


async def indexed(nodes: nodes_pb2_grpc.NodesAsyncStub) -> int:
    resp = await nodes.List(nodes_pb2.ListNodesRequest(), timeout=5)
    return next((n.indexed_blocks for n in resp.nodes if n.engine_id == ENGINE_ID and n.alive), -1)


async def wait_indexed(nodes: nodes_pb2_grpc.NodesAsyncStub, count: int, timeout_s: float = 120.0) -> float:
    """Poll until the daemon indexes `count` blocks of the node. -> the time it did."""
    deadline = time.perf_counter() + timeout_s
    while (got := await indexed(nodes)) != count:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"daemon index at {got}, expected {count}")
        await asyncio.sleep(0.005)
    return time.perf_counter()


async def spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvferry_cli", *args, stdin=asyncio.subprocess.DEVNULL
    )


async def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.perf_counter() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            if time.perf_counter() > deadline:
                raise TimeoutError(url)
            await asyncio.sleep(0.05)


async def ttfb(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    body = {
        "messages": [{"role": "user", "content": "Name three ferries. " * 8}],
        "max_tokens": 8,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        first = await r.content.readany()
        elapsed = time.perf_counter() - t0
        assert r.status == 200 and first.startswith(b"data: "), first[:200]
        await r.read()
    return elapsed


Rows = list[tuple[str, str, str]]
"""The table the benchmark prints: (figure, value, note), in order."""


async def start_engine_and_sidecar(
    daemon_port: int, publisher: Publisher
) -> tuple[list[asyncio.subprocess.Process], str, str]:
    """An emulated D (`kvferry emulate`) and `kvferry sidecar` in front of it, on the daemon
    at `daemon_port`, reading `publisher`'s KV events. -> (their processes, the engine's
    URL, the sidecar's)."""
    engine_port, tap_port = free_port(), free_port()
    procs = [
        await spawn(
            "emulate", "--port", str(engine_port), "--side-channel-port", str(free_port()),
            "--role", "decode", "--log-level", "warning",
        ),
        await spawn(
            "sidecar", "--log-level", "warning", "--engine-url", f"http://127.0.0.1:{engine_port}",
            "--listen", f"127.0.0.1:{tap_port}", "--daemon", f"127.0.0.1:{daemon_port}",
            "--engine-id", ENGINE_ID, "--side-channel-host", "127.0.0.1",
            "--kv-events-endpoint", publisher.endpoint,
            "--kv-events-replay-endpoint", publisher.replay_endpoint,
        ),
    ]  # fmt: skip
    return procs, f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{tap_port}"


async def wait_attached(
    engine: str, tap: str, nodes: nodes_pb2_grpc.NodesAsyncStub, publisher: Publisher
) -> None:
    """Until the engine and the sidecar answer, the node is registered and attached, and a
    first block published is indexed (a warm-up, and the slow joiner's replay)."""
    await wait_http(engine + "/health")
    await wait_http(tap + "/kvferry/metrics")
    deadline = time.perf_counter() + 30
    while await indexed(nodes) < 0:  # registered and attached
        if time.perf_counter() > deadline:
            raise TimeoutError("the sidecar did not register the node")
        await asyncio.sleep(0.02)
    publisher.publish_all(stored_payloads(1, 1, 1, 1))  # warm-up (and the slow joiner's replay)
    await wait_indexed(nodes, 1)


async def ingest(
    daemon_pid: int,
    publisher: Publisher,
    nodes: nodes_pb2_grpc.NodesAsyncStub,
    args: argparse.Namespace,
    rows: Rows,
) -> None:
    """1. KV-event ingest: args.hashes blocks stored, then removed; and the daemon's memory
    per indexed block."""
    n, per_event, per_batch = args.hashes, args.per_event, args.per_batch
    store = stored_payloads(1_000, n, per_event, per_batch)
    remove = removed_payloads(1_000, n, per_event, per_batch)
    phases = (("BlockStored", store, n + 1), ("BlockRemoved", remove, 1))
    for label, payloads, target in phases:
        rss_before = _rss_bytes(daemon_pid)
        t0 = time.perf_counter()
        publisher.publish_all(payloads)
        secs = await wait_indexed(nodes, target) - t0
        if label == "BlockStored":
            grown = _rss_bytes(daemon_pid) - rss_before
            rows.append(
                (
                    "daemon memory per indexed block",
                    f"{grown / n:.0f} bytes",
                    f"daemon RSS grew {grown / 2**20:.1f} MiB for {n:,} blocks",
                )
            )
        rows.append(
            (
                f"KV ingest, {label} -> daemon index",
                f"{n / secs:,.0f} hashes/s",
                f"{n:,} hashes in {len(payloads):,} payloads, {secs:.2f}s",
            )
        )
        print(f"{label}: {n / secs:,.0f} hashes/s", file=sys.stderr)


async def ttfb_rows(engine: str, tap: str, requests: int, rows: Rows) -> None:
    """2. TTFB, straight vs through the sidecar, interleaved: `requests` samples a path."""
    paths = {
        "engine": (engine, {}),
        "sidecar, pass-through": (tap, {}),
        "sidecar, tapped (conversation)": (
            tap,
            {"X-Conversation-Id": "bench", "X-Kvferry-Tenant": "bench"},
        ),
    }
    samples: dict[str, list[float]] = {p: [] for p in paths}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(20):  # warm connections and code paths
            for url, headers in paths.values():
                await ttfb(session, url, headers)
        for _ in range(requests):
            for name, (url, headers) in paths.items():
                samples[name].append(await ttfb(session, url, headers))
    base = pct(samples["engine"], 50)
    for name, xs in samples.items():
        p50 = pct(xs, 50)
        extra = "" if name == "engine" else f"+{p50 - base:.3f} ms at p50"
        rows.append((f"TTFB, {name}", f"{p50:.3f} / {pct(xs, 90):.3f} / {pct(xs, 99):.3f} ms", extra))


async def bench(args: argparse.Namespace) -> None:
    """Start the daemon, the engine and its sidecar; run both measurements; print the table."""
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-bench-sidecar-"))
    daemon, daemon_port = await start_daemon(tmp / "etcd")
    publisher = Publisher()
    procs, engine, tap = await start_engine_and_sidecar(daemon_port, publisher)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{daemon_port}")
    nodes = nodes_pb2_grpc.NodesStub(channel)
    rows: Rows = []
    try:
        await wait_attached(engine, tap, nodes, publisher)
        await ingest(daemon.pid, publisher, nodes, args, rows)
        await ttfb_rows(engine, tap, args.requests, rows)
    finally:
        await channel.close(None)
        for proc in [*procs, daemon]:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await proc.wait()
        await publisher.close()
        shutil.rmtree(tmp, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{width}}  {'value (TTFB: p50 / p90 / p99)':<34}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:<34}  {note}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--hashes", type=int, default=1_000_000, help="block hashes stored, then removed")
    p.add_argument(
        "--per-event", type=int, default=32, help="hashes per BlockStored event (a 512-token prompt)"
    )
    p.add_argument("--per-batch", type=int, default=1024, help="hashes per published payload")
    p.add_argument("--requests", type=int, default=400, help="TTFB samples per path")
    args = p.parse_args()

    async def run() -> int:
        await bench(args)
        return 0

    run_main(run())


if __name__ == "__main__":
    main()

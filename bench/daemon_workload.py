"""What the daemon benchmarks (bench.daemon, bench.lookup_tail) send, and to what: the
retention each conversation registers, the lookup of its next turn, the decode node they
name, and `kvferry daemon` in a process of its own, restartable, its etcd counters read
from its /metrics."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc

from controlplane.embedded import with_parent_death_signal
from kvferry.digests import block_digests, seed
from kvferry.framedstream import FramedCall
from kvferry.leaseclient import LeaseStream
from kvferry.structs import dict_to_struct
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from realvllm.process import free_port, stop_child

BLOCK = 16
TOKENS = 2048  # per conversation: 128 blocks of ids and digests (~3.7 KB per record)
SEED = seed("bench-model")
DIGESTS = block_digests(list(range(TOKENS)), BLOCK, SEED)
PROMPT_DIGESTS = block_digests(list(range(TOKENS + 300)), BLOCK, SEED)


def retention(conv: str) -> leases_pb2.RegisterLeaseRequest:
    """The registration of conversation `conv`'s retention on d-0, as the sidecar sends it."""
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
    """The decode node every benchmark retention is registered under."""
    await nodes_pb2_grpc.NodesStub(channel).Register(
        nodes_pb2.RegisterNodeRequest(
            engine_id="d-0", role=nodes_pb2.DECODE, model="bench-model", block_size=BLOCK,
            http_url="http://127.0.0.1:1", side_channel_host="10.0.0.7", side_channel_port=5600,
            liveness_ttl_seconds=3600,
        )
    )  # fmt: skip


def lookup(conv: str) -> leases_pb2.LookupRequest:
    """The next turn's lookup of conversation `conv`: its prompt extends the retained one."""
    return leases_pb2.LookupRequest(
        tenant="bench", conversation_id=conv, prompt_tokens=TOKENS + 300, prompt_digests=PROMPT_DIGESTS
    )


class DaemonProcess:
    """`kvferry daemon` in its own process: on its embedded etcd (kept in `data_dir`), or on
    the external etcd at `etcd` under `prefix`. `tree` and `module` name another checkout's
    daemon (bench.daemon_ab: the module that runs ``kvferry`` there, ``kvferry.cli`` before
    the command line got its own package; such a daemon serves no framed stream)."""

    def __init__(
        self,
        data_dir: Path | None = None,
        etcd: str = "",
        *,
        prefix: str = "",
        port: int = 0,
        stream_port: int = 0,
        args: Sequence[str] = (),
        tree: Path | None = None,
        module: str = "kvferry_cli",
    ) -> None:
        """`port` and `stream_port` (0: free ones) are its --listen's and --stream-listen's: a
        daemon that replaces another one takes both of its ports, as a restart does. `args`:
        more flags for `kvferry daemon` (a policy's, say)."""
        self.data_dir = data_dir
        self.etcd = etcd
        self.prefix = prefix
        self.port = port or free_port()
        self.stream_port = stream_port or free_port()
        """Its --stream-listen port (the framed Leases/Stream: kvferry.framedstream)."""
        self.metrics_port = free_port()
        self.args = tuple(args)
        self.tree = tree
        self.module = module
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stream_address(self) -> str:
        """Its --stream-listen address: Leases/Stream framed, without gRPC (routers look up there)."""
        return f"127.0.0.1:{self.stream_port}"

    def _store_flags(self) -> list[str]:
        if self.etcd:
            return ["--etcd", self.etcd, *(["--etcd-prefix", self.prefix] if self.prefix else [])]
        assert self.data_dir is not None, "an embedded etcd needs a data directory"
        return ["--data-dir", str(self.data_dir), "--embedded-port", str(free_port())]

    async def start(self, timeout_s: float = 60.0) -> float:
        """Start and wait until a Lookup is answered from the store. -> seconds from exec to serving."""
        t0 = time.perf_counter()
        command = [
            sys.executable, "-m", self.module, "--log-level", "warning", "daemon",
            "--listen", self.address, "--metrics-port", str(self.metrics_port), *self._store_flags(),
            *(["--stream-listen", self.stream_address] if self.tree is None else []), *self.args,
        ]  # fmt: skip
        # (a benchmark killed leaves no daemon behind)
        self.proc = await asyncio.create_subprocess_exec(
            *with_parent_death_signal(command), stdin=asyncio.subprocess.DEVNULL, cwd=self.tree
        )
        fast_retry = [
            ("grpc.initial_reconnect_backoff_ms", 20),
            ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 50),
        ]
        async with (
            grpc.aio.insecure_channel(self.address, options=fast_retry) as ch,
            asyncio.timeout(timeout_s),
        ):
            stub = leases_pb2_grpc.LeasesStub(ch)
            while True:
                try:
                    r = await stub.Lookup(lookup("probe"), timeout=1, wait_for_ready=True)
                    if r.reason != "store_unavailable":
                        return time.perf_counter() - t0
                except grpc.aio.AioRpcError:
                    if self.proc.returncode is not None:
                        raise RuntimeError(
                            f"kvferry daemon exited at start ({self.proc.returncode})"
                        ) from None
                await asyncio.sleep(0.01)

    def lease_stream(self, framed: bool) -> LeaseStream:
        """A LeaseStream to this daemon: over gRPC, or framed (--stream-listen)."""
        if framed:
            return LeaseStream(None, opener=lambda: FramedCall("127.0.0.1", self.stream_port))
        return LeaseStream(grpc.aio.insecure_channel(self.address))

    async def restart(self) -> float:
        """Stop (SIGTERM, if running) and start again. -> seconds from SIGTERM to serving."""
        t0 = time.perf_counter()
        await self.stop()
        await self.start()
        return time.perf_counter() - t0

    async def stop(self) -> None:
        """SIGTERM (SIGKILL if it lingers); returns once it has exited."""
        if self.proc is not None:
            await stop_child(self.proc)

    async def kill(self) -> None:
        """SIGKILL: no graceful stop, no claims settled, connections reset."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    @property
    def metrics_address(self) -> str:
        """Where its /metrics page is served."""
        return f"127.0.0.1:{self.metrics_port}"

    def metrics(self) -> dict[str, float]:
        text = metrics_page(self.metrics_address)
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


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def metrics_page(address: str) -> str:
    """The Prometheus /metrics page served at `address` (host:port): a daemon's or etcd's."""
    page: bytes = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read()
    return page.decode()


def histogram(text: str, name: str, bound: float, **labels: str) -> tuple[float, float, float]:
    """The Prometheus histogram `name` in a /metrics page (its series with `labels`): (count,
    sum, how many were over `bound`, one of its bucket bounds)."""
    count = total = under = 0.0
    for line in text.splitlines():
        series, _, value = line.partition(" ")
        metric, _, rest = series.partition("{")
        found = dict(_LABEL.findall(rest))
        le = found.pop("le", None)
        if found != labels:
            continue
        if metric == f"{name}_count":
            count = float(value)
        elif metric == f"{name}_sum":
            total = float(value)
        elif metric == f"{name}_bucket" and le is not None and le != "+Inf" and float(le) == bound:
            under = float(value)
    return count, total, count - under


class MetricsPhase:
    """A /metrics page over one phase of a benchmark: read when the phase begins and at
    `end()`, once each, however many histograms are asked of it."""

    def __init__(self, address: str) -> None:
        """`address`: host:port of the page (see `metrics_page`)."""
        self._address = address
        self._before = metrics_page(address)
        self._after = self._before

    def end(self) -> None:
        self._after = metrics_page(self._address)

    def gained(self, name: str, bound: float, **labels: str) -> tuple[float, float, float]:
        """Histogram `name`'s (count, sum, over `bound`) over the phase."""
        after, before = (
            histogram(self._after, name, bound, **labels),
            histogram(self._before, name, bound, **labels),
        )
        return after[0] - before[0], after[1] - before[1], after[2] - before[2]


DAEMON_STALLS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("lookups waited on a confirming read", "kvferry_lookup_wait_seconds", {"on": "node_confirm"}),
    ("event loop ticks late", "kvferry_event_loop_lag_seconds", {}),
    *((f"GC pauses, generation {g}", "kvferry_gc_pause_seconds", {"generation": g}) for g in "012"),
)
"""What held the daemon's lookups, by its own histograms (controlplane.stalls): (what, name, labels)."""


def daemon_stalls(phase: MetricsPhase, bound: float) -> list[tuple[str, tuple[float, float, float]]]:
    """DAEMON_STALLS over `phase` (the daemon's /metrics, ended): (what, (count, sum, over `bound`))."""
    return [(what, phase.gained(name, bound, **labels)) for what, name, labels in DAEMON_STALLS]

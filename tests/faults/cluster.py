"""The processes the fault suite breaks: a 3-member etcd cluster on loopback and
``kvferry daemon`` replicas on it, each in a process of its own that a test can
kill, stop (SIGSTOP) and start again."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import grpc

from controlplane.embedded import etcd_binary
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc
from realvllm.process import free_port, stop_child


@dataclass
class Member:
    """One etcd member: its ports and data directory stay the same across restarts."""

    name: str
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    proc: asyncio.subprocess.Process | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def command(self, initial_cluster: str) -> list[str]:
        client = f"http://{self.endpoint}"
        return [
            str(etcd_binary()),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial_cluster}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=kvferry-faults",
            "--log-level=warn",
            # etcd's defaults (100 ms, 1 s): shorter ones elect needlessly on a loaded 2-core
            # machine, where a member's heartbeat can be late by hundreds of milliseconds.
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=10s",
        ]


class EtcdCluster:
    """Three etcd members on loopback, each stopped and started on its own."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = root
        self.members = [Member(f"m{i}", root / f"m{i}") for i in range(size)]

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    async def start(self) -> None:
        """Start every member and wait until the cluster has a leader."""
        for m in self.members:
            await self.start_member(m)
        await self.wait_healthy()

    async def start_member(self, m: Member) -> None:
        """Start (or restart, on its data) one member; it rejoins on its own."""
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        with open(self.root / f"{m.name}.log", "ab") as out:  # noqa: ASYNC230 - once, at start
            m.proc = await asyncio.create_subprocess_exec(
                *m.command(initial), stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL
            )

    async def kill(self, m: Member) -> None:
        """SIGKILL: no goodbye to the peers, no flush."""
        if m.proc is not None and m.proc.returncode is None:
            m.proc.send_signal(signal.SIGKILL)
            await m.proc.wait()

    async def stop(self) -> None:
        for m in self.members:
            await self.kill(m)

    async def _etcdctl(self, *args: str, endpoints: tuple[str, ...] | None = None) -> tuple[int, str]:
        ctl = etcd_binary().with_name("etcdctl")
        proc = await asyncio.create_subprocess_exec(
            str(ctl), f"--endpoints={','.join(endpoints or self.endpoints)}", "--dial-timeout=1s",
            "--command-timeout=2s", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode()

    async def leader(self) -> Member | None:
        """The member that leads now, by the running members' own account (None: none does)."""
        running = tuple(m.endpoint for m in self.members if m.running)
        if not running:
            return None
        _, out = await self._etcdctl("endpoint", "status", "-w", "json", endpoints=running)
        try:
            statuses = json.loads(out or "[]")
        except ValueError:
            return None
        for s in statuses:
            header = s.get("Status", {}).get("header", {})
            if header.get("member_id") and header.get("member_id") == s["Status"].get("leader"):
                return next(m for m in self.members if m.endpoint == s["Endpoint"].removeprefix("http://"))
        return None

    async def wait_writable(self, via: Member, timeout_s: float = 60.0) -> float:
        """Until a write through `via` commits (the cluster has quorum and a leader), trying
        every 50 ms. -> when it did (time.monotonic())."""
        client = aetcd.Client("127.0.0.1", via.client_port, timeout=1)
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    try:
                        await client.put(b"/faults-probe", b"1")
                        return time.monotonic()
                    except (aetcd.ClientError, grpc.aio.AioRpcError):
                        await asyncio.sleep(0.05)
        finally:
            await client.close()

    async def lead(self, m: Member) -> None:
        """Make `m` the leader (etcdctl move-leader, sent to the leader now), and wait for it."""
        async with asyncio.timeout(30):
            while (leader := await self.wait_healthy()) is not m:
                _, out = await self._etcdctl("endpoint", "status", "-w", "json", endpoints=(m.endpoint,))
                target = json.loads(out)[0]["Status"]["header"]["member_id"]
                await self._etcdctl("move-leader", f"{target:x}", endpoints=(leader.endpoint,))

    async def wait_healthy(self, timeout_s: float = 60.0) -> Member:
        """Until every running member answers and one of them leads. -> the leader."""
        running = tuple(m.endpoint for m in self.members if m.running)
        async with asyncio.timeout(timeout_s):
            while True:
                code, _ = await self._etcdctl("endpoint", "health", endpoints=running)
                leader = await self.leader() if code == 0 else None
                if leader is not None:
                    return leader
                await asyncio.sleep(0.2)


class DaemonProcess:
    """``kvferry daemon`` on the cluster, in a process of its own (its log: `log_path`)."""

    def __init__(self, name: str, endpoints: tuple[str, ...], prefix: str, root: Path) -> None:
        self.name = name
        self.endpoints = endpoints
        self.prefix = prefix
        self.port = free_port()
        self.log_path = root / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Start it and wait until it answers Nodes/List."""
        with open(self.log_path, "ab") as out:  # noqa: ASYNC230 - once, at start
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvferry_cli", "--log-level", "info", "daemon",
                "--listen", self.address, "--metrics-port", "-1",
                "--etcd", ",".join(self.endpoints), "--etcd-prefix", self.prefix,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        async with grpc.aio.insecure_channel(self.address) as channel, asyncio.timeout(60):
            stub = nodes_pb2_grpc.NodesStub(channel)
            while True:
                try:
                    await stub.List(nodes_pb2.ListNodesRequest(), timeout=1)
                    return
                except grpc.aio.AioRpcError:
                    if self.proc.returncode is not None:
                        raise RuntimeError(
                            f"daemon {self.name} exited at start; see {self.log_path}"
                        ) from None
                    await asyncio.sleep(0.1)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None and self.proc.returncode is None
        self.proc.send_signal(sig)

    async def stop(self) -> None:
        """SIGTERM (a stopped process gets SIGCONT first), then SIGKILL after 15 s."""
        if self.proc is not None:
            await stop_child(self.proc)

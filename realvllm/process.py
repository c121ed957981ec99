"""An engine as a child process: started in its own process group, ready when its
``/health`` answers 200, stopped with SIGTERM (SIGKILL after a grace), restartable on
the same ports. Used for real vLLM engines and for the emulator run the same way, so
that a test or a benchmark drives both through one interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


class EngineFailed(RuntimeError):
    """The engine process exited or did not become ready; the message holds its log's tail."""


class PortTaken(EngineFailed):
    """A port the engine was told to listen on was taken before it could bind it."""


_PORT_FLOOR = 10000
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_pick = random.SystemRandom()
"""Its own source of ports: the global `random` is seeded alike in every process by some
callers (Hypothesis, inside its tests), and two test processes would then pick alike."""


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    for address in {host, "0.0.0.0"}:
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` and on the wildcard address right now, never handed out
    before by this process, and below the kernel's ephemeral range: an engine binds its
    ports a minute after they are picked, and a port from that range can meanwhile be
    taken by any outgoing connection on the machine (a CI run lost its D that way)."""
    ceiling = _ephemeral_floor()
    with _handed_out_lock:
        for _ in range(500):
            if ceiling <= _PORT_FLOOR:
                break
            port = _pick.randrange(_PORT_FLOOR, ceiling)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        with socket.socket() as s:  # (no room below the ephemeral range: the kernel's pick)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port


async def stop_child(proc: asyncio.subprocess.Process, grace_s: float = 15.0) -> None:
    """SIGTERM an asyncio child process (SIGCONT first: a stopped one could not act on it),
    SIGKILL it if it has not exited within `grace_s`; returns once it has. Idempotent."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def log_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file (empty when there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (a test
    run killed by its timeout leaves no engine behind; the engine stops its own children)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1
_PORT_TAKEN = b"Address already in use"


class EngineProcess:
    """One engine process: a command line, its environment, its log and health URL."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str],
        http_url: str,
        log_path: Path,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.env = dict(env)
        self.http_url = http_url
        self.log_path = log_path
        self.cwd = cwd
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_read = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Spawn the process (its output appended to the log); returns at once."""
        if self.running():
            raise RuntimeError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._log_read = out.tell()  # (this start's part of the log begins here)
            out.write(f"\n=== start {self.starts + 1}: {' '.join(self.command)}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                # (only from the main thread: the signal comes when the *thread* that
                # started the child ends, and a worker thread's end is no reason)
                preexec_fn=_die_with_parent
                if threading.current_thread() is threading.main_thread()
                else None,
            )
        self.starts += 1

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.http_url + "/health", timeout=timeout_s) as r:
                return int(r.status) == 200
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ``/health`` answers 200; -> seconds waited. Raises EngineFailed with
        the log's tail when the process exits or the time runs out."""
        started = time.monotonic()
        deadline = started + timeout_s
        while not self.healthy():
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise EngineFailed(f"{self.name} exited ({code}):\n{log_tail(self.log_path)}")
            if self._log_says(_PORT_TAKEN):
                # (vLLM's side-channel thread dies on it and the engine waits forever)
                self.stop()
                raise PortTaken(f"{self.name}: a port was taken:\n{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineFailed(
                    f"{self.name} not ready after {timeout_s:.0f} s:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.25)
        return time.monotonic() - started

    def _log_says(self, needle: bytes) -> bool:
        """Whether this start's part of the log contains `needle` (each call reads only what
        was written since the last, plus a needle's length of overlap)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_read)
                new = log.read()
        except OSError:
            return False
        self._log_read += max(0, len(new) - len(needle))
        return needle in new

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        # Children a clean exit left behind (vLLM's engine core and workers) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL at once (a crash, as an operator or the OOM killer would cause)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP the whole group (a stalled engine: alive, silent)."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def restart(self, timeout_s: float) -> float:
        """Stop, start on the same command line (same ports), wait ready; -> seconds to ready."""
        self.stop()
        self.start()
        return self.wait_ready(timeout_s)

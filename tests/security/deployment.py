"""deploy/compose/compose.yaml, started on this machine's loopback as processes.

Every service runs the command and the KVFERRY_* variables the compose file gives it, so
what the tests attack is the deployment deploy/ describes (its TLS files, its policy, its
flags), not a configuration of the test's own. Only what a single host forces changes:
- each service's ports become free loopback ports (compose gives every service its own
  network namespace, so prefill and decode both use 8000 there), and the other services'
  names become ``localhost`` (which the development CA's certificates name);
- the volumes' paths (/etc/kvferry, /var/lib/kvferry) become directories of the test;
- the daemon's embedded etcd gets free ports too (KVFERRY_EMBEDDED_PORT, added).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from realvllm.process import free_port

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "compose.yaml"
ORDER = ("certs", "daemon", "prefill", "decode", "prefill-sidecar", "decode-sidecar", "router")
_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{2,5})\b")
_PORT_FLAG = re.compile(r"^(?P<flag>--[a-z-]*port)=(?P<port>\d+)$")
_HOST_FLAG = re.compile(r"^(?P<flag>--[a-z-]*host)=(?P<host>[a-z0-9.\-]+)$")


@dataclass
class Deployment:
    """The compose services as processes: where each listens, and the certificates."""

    root: Path
    services: dict[str, dict[str, Any]]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def certs(self) -> Path:
        return self.root / "var" / "certs"

    def namespace(self, service: str) -> str:
        """The service whose network a service shares (compose's network_mode service:X)."""
        mode = str(self.services[service].get("network_mode", ""))
        return mode.removeprefix("service:") if mode.startswith("service:") else service

    def port(self, service: str, port: int) -> int:
        """The loopback port standing in for `port` in `service`'s network namespace."""
        key = (self.namespace(service), port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return self.ports[key]

    def address(self, service: str, port: int) -> str:
        return f"localhost:{self.port(service, port)}"

    def _host_port(self, service: str, m: re.Match[str]) -> str:
        host, port = m["host"], int(m["port"])
        if host in ("0.0.0.0", "127.0.0.1", "localhost"):
            return f"127.0.0.1:{self.port(service, port)}"
        if host in self.services:
            return f"localhost:{self.port(host, port)}"
        return m.group(0)

    def rewrite(self, service: str, value: str, env: str = "") -> str:
        """One value of `service`'s command or environment, for this host."""
        value = value.replace("/etc/kvferry", str(self.root / "etc")).replace(
            "/var/lib/kvferry", str(self.root / "var")
        )
        if m := _PORT_FLAG.match(value):
            return f"{m['flag']}={self.port(service, int(m['port']))}"
        if m := _HOST_FLAG.match(value):
            return f"{m['flag']}=localhost" if m["host"] in self.services else value
        if env.endswith("_PORT") and value.isdigit() and env != "KVFERRY_METRICS_PORT":
            return str(self.port(service, int(value)))
        if env.endswith("_HOST") and value in self.services:
            return "localhost"
        return _ADDRESS.sub(lambda m: self._host_port(service, m), value)

    def command(self, service: str) -> tuple[list[str], dict[str, str]]:
        spec = self.services[service]
        argv = [self.rewrite(service, str(a)) for a in spec.get("command", [])]
        env = {k: self.rewrite(service, str(v), k) for k, v in (spec.get("environment") or {}).items()}
        if service == "daemon":
            env["KVFERRY_EMBEDDED_PORT"] = str(free_port())
            env["KVFERRY_METRICS_PORT"] = str(
                self.port("daemon", int(env.get("KVFERRY_METRICS_PORT", "9464")))
            )
        return argv, env

    def start(self, service: str) -> subprocess.Popen[bytes]:
        argv, env = self.command(service)
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
        with (self.root / f"{service}.log").open("wb") as log:  # (the child keeps its own copy)
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvferry_cli", *argv],
                env={**base, **env, "KVFERRY_LOG_LEVEL": "info"},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
            )
        self.procs[service] = proc
        return proc

    def log(self, service: str) -> str:
        return (self.root / f"{service}.log").read_text(errors="replace")

    def stop(self) -> None:
        for service in reversed(list(self.procs)):
            proc = self.procs[service]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(what: str, ready: Any, deployment: Deployment, timeout_s: float = 90.0) -> Any:
    """Poll `ready()` until it returns something true; a service that exited fails at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if got := ready():
                return got
        for name, proc in deployment.procs.items():
            if proc.poll() is not None and name != "certs":
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{deployment.log(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout_s} s")
        time.sleep(0.1)


@contextlib.contextmanager
def compose_deployment(root: Path) -> Iterator[Deployment]:
    """Start every service of compose.yaml in order; stop them all at the end."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(services) == set(ORDER), f"compose.yaml's services changed: {sorted(services)}"
    d = Deployment(root, services)
    (root / "etc").mkdir()
    (root / "var").mkdir()
    (root / "etc" / "certs").symlink_to(d.certs, target_is_directory=True)  # (its volume, read-only there)
    try:
        certs = d.start("certs")
        assert certs.wait(60) == 0, d.log("certs")
        for service in ORDER[1:]:
            d.start(service)
        yield d
    finally:
        d.stop()

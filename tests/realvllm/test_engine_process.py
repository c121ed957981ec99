"""The engine harness of the real-vLLM suite: ports no outgoing connection can take, and
an engine that lost a port fails at once instead of after the readiness timeout."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from realvllm.process import EngineProcess, PortTaken, free_port

_HEALTHY_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _ephemeral_floor() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port < _ephemeral_floor() for port in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_an_engine_that_lost_a_port_fails_at_once_and_a_later_start_is_judged_afresh(
    tmp_path: Path,
) -> None:
    port = free_port()
    lost = [
        sys.executable,
        "-c",
        "import time; print('zmq.error.ZMQError: Address already in use', flush=True); time.sleep(600)",
    ]
    engine = EngineProcess("e", lost, {}, f"http://127.0.0.1:{port}", tmp_path / "e.log")
    engine.start()
    started = time.monotonic()
    with pytest.raises(PortTaken, match="Address already in use"):
        engine.wait_ready(timeout_s=300)
    assert time.monotonic() - started < 120
    assert not engine.running()

    # The same log still holds the old line; a start that binds fine is ready.
    engine.command = [sys.executable, "-c", _HEALTHY_SERVER, str(port)]
    engine.start()
    try:
        engine.wait_ready(timeout_s=120)
    finally:
        engine.stop()

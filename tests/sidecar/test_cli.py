"""`kvferry sidecar` as a process: flags, environment, registration, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import aiohttp
import pytest

from controlplane.daemon import Daemon
from kvferry.v1 import nodes_pb2
from sidecar.cli import build_parser
from tests.conftest import Client, free_port
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator


async def _alive(client: Client, engine_id: str) -> bool:
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    return any(n.engine_id == engine_id and n.alive for n in nodes)


async def test_the_command_registers_serves_and_stops_cleanly(
    daemon: Daemon, client: Client, start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    d = await start_emulator(role="decode")
    port = free_port()
    env = {**os.environ, "KVFERRY_SIDECAR_ENGINE_ID": "cli-node", "KVFERRY_SIDECAR_LIVENESS_TTL": "2"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.cli", "--log-level", "warning",
        "--engine-url", d.http_url, "--listen", f"127.0.0.1:{port}", "--daemon", daemon.address,
        "--side-channel-host", "127.0.0.1", "--side-channel-port", str(d.side_channel_port),
        env=env, stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await eventually(lambda: _alive(client, "cli-node"), within=20)
        async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_invalid_settings_exit_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.cli", "--role", "router",
        stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2 and b"role must be one of" in err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--engine-id", "d" * 257], "engine id is 257 bytes, at most 256"),
        (["--engine-id", "d\t1"], "engine id contains control characters"),
        (["--kv-events-endpoint", "tcp://enginehost"], "must be a ZMQ endpoint (tcp://host:port)"),
        (["--kv-events-endpoint", "tcp://enginehost:port"], "must be a ZMQ endpoint (tcp://host:port)"),
    ],
)
def test_settings_the_daemon_or_zmq_would_refuse_are_refused_at_start(argv: list[str], problem: str) -> None:
    """Refused later, they looped: the daemon's INVALID_ARGUMENT read as "unreachable" (a
    failover a second, forever), ZMQ's connect a traceback a second."""
    from sidecar import settings

    with pytest.raises(ValueError, match=re.escape(problem)):
        settings.from_args(build_parser().parse_args(argv))

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
from emulator import EmulatorServer
from kvferry.v1 import leases_pb2, nodes_pb2
from realvllm.process import free_port
from sidecar.cli import build_parser
from tests.conftest import Client
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator
from tests.sidecar.helpers import chat, first_turn, prefill


async def _alive(client: Client, engine_id: str) -> bool:
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    return any(n.engine_id == engine_id and n.alive for n in nodes)


async def _sidecar_process(daemon: Daemon, d: EmulatorServer, port: int) -> asyncio.subprocess.Process:
    env = {**os.environ, "KVFERRY_SIDECAR_ENGINE_ID": "cli-node", "KVFERRY_SIDECAR_LIVENESS_TTL": "2"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.cli", "--log-level", "warning",
        "--engine-url", d.http_url, "--listen", f"127.0.0.1:{port}", "--daemon", daemon.address,
        "--side-channel-host", "127.0.0.1", "--side-channel-port", str(d.side_channel_port),
        env=env, stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def test_the_command_registers_serves_and_stops_cleanly(
    daemon: Daemon, client: Client, start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    d = await start_emulator(role="decode")
    port = free_port()
    proc = await _sidecar_process(daemon, d, port)
    try:
        await eventually(lambda: _alive(client, "cli-node"), within=20)
        async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:  # the engine's, through it
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == [d.config.model]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_killed_sidecars_node_is_gone_after_its_liveness_ttl(
    daemon: Daemon, client: Client, start_emulator: StartEmulator, http: aiohttp.ClientSession
) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    port = free_port()
    proc = await _sidecar_process(daemon, d, port)
    try:
        await eventually(lambda: _alive(client, "cli-node"), within=20)
        messages = first_turn("ferries")
        p1 = await prefill(http, p.http_url, messages)
        headers = {"X-Conversation-Id": "conv"}
        d1 = await chat(http, f"http://127.0.0.1:{port}", messages, headers, kv_transfer_params=p1.params)
        assert d1.status == 200 and d1.params is not None, d1.body

        async def held() -> bool:
            return (await _lookup(client, "conv")).decision == leases_pb2.PULL

        await eventually(held)
        proc.kill()  # no Deregister, no goodbye: only the heartbeats stop
        await proc.wait()
        killed = asyncio.get_running_loop().time()

        async def gone() -> bool:
            answer = await _lookup(client, "conv")
            return (answer.decision, answer.reason) == (leases_pb2.RECOMPUTE, "node_gone")

        await eventually(gone, within=15)
        # The TTL from the environment (2 s, not the default 10 s), give or take etcd's
        # 500 ms expiry tick and the daemon's node view.
        assert asyncio.get_running_loop().time() - killed < 8
        assert not await _alive(client, "cli-node")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _lookup(client: Client, conversation: str) -> leases_pb2.LookupResponse:
    return await client.leases.Lookup(
        leases_pb2.LookupRequest(conversation_id=conversation, prompt_tokens=10_000, peek=True)
    )


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

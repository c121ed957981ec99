"""A stalled engine is suspended, not restarted; a hung daemon replica is left in time.

Both with real engines (emulators), real daemons on a real etcd, and proxies that
stall: an HTTP one in front of the engine (its API server busy, its probes timing
out) and a TCP one in front of a daemon replica (it accepts and answers nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
from aiohttp import web

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2
from sidecar import Sidecar
from tests.conftest import Client, DaemonFactory, serve_app
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar, sidecar_settings
from tests.sidecar.test_node import _alive_at, _counted, _d_turn, _lookup, _node

_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@contextlib.asynccontextmanager
async def stalling_proxy(target: str, flowing: asyncio.Event) -> AsyncIterator[str]:
    """An HTTP forwarder to `target` that holds every request while `flowing` is clear."""
    async with aiohttp.ClientSession() as session:

        async def forward(request: web.Request) -> web.Response:
            await flowing.wait()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            body = await request.read()
            async with session.request(
                request.method, target + request.path_qs, data=body, headers=headers
            ) as r:
                kept = {k: v for k, v in r.headers.items() if k.lower() == "content-type"}
                return web.Response(status=r.status, body=await r.read(), headers=kept)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        async with serve_app(app) as url:
            try:
                yield url
            finally:
                flowing.set()  # release held requests, or their handlers outlive the test


async def test_a_stalled_engine_is_suspended_and_keeps_its_retentions(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar
) -> None:
    """D's API server stops answering for longer than the health window, then answers
    again, the same process: its retentions answer node_gone meanwhile (nothing to hand
    out to a D that may be gone), and are good again after. It was taken for a restart:
    a new generation, every retention dead while D still held their blocks."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    flowing = asyncio.Event()
    flowing.set()
    async with stalling_proxy(d.http_url, flowing) as url, aiohttp.ClientSession() as http:
        sc = await start_sidecar(d, engine__url=url, engine__health_timeout_s=0.3)
        node_id = sc.settings.node_id
        await eventually(lambda: _alive_at(client, node_id, 1))
        await _d_turn(http, p, sc, "kept")
        assert sc.retentions is not None and await sc.retentions.wait_idle(5)

        flowing.clear()  # the stall

        async def handed_nothing() -> bool:
            answer = await _lookup(client, "kept")
            return (answer.decision, answer.reason) == (leases_pb2.RECOMPUTE, "node_gone")

        # (The replica answers node_gone as the stream ends; etcd has the suspension an
        # fsync later. Room for both on a busy machine: it once took over 5 s in CI.)
        await eventually(handed_nothing, within=15)

        async def suspended() -> bool:
            node = await _node(client, node_id)
            return node is not None and node.suspended and node.generation == 1

        await eventually(suspended, within=15)
        flowing.set()

        await eventually(lambda: _alive_at(client, node_id, 1))
        assert (await _lookup(client, "kept")).decision == leases_pb2.PULL
        assert sc.metrics.value("kvferry_sidecar_engine_suspensions_total", signal="failed") == 1
        assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="health") == 0
        assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="identity") == 0


class HangingProxy:
    """A TCP forwarder to a daemon replica that, once `hang()` is called, forwards
    nothing more either way while keeping every connection open (a replica hung, or
    its host stopped: it accepts and answers nothing)."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def hang(self) -> None:
        self.flowing.clear()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self.flowing.wait()
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


TTL_S = 6
"""The liveness TTL of the failover test: the failover must fit in it on a loaded 2-core CI
machine (at 4 s it lapsed there now and then while a replica was healthy)."""


async def test_a_hung_daemon_replica_is_left_before_the_node_lapses(
    daemon: Daemon, make_daemon: DaemonFactory, connect: object, start_emulator: StartEmulator
) -> None:
    """The replica the sidecar is attached to hangs: heartbeats go unanswered. The sidecar
    gave it up only after a whole liveness TTL without an answer (and a call on it after
    five seconds), by which time the node had lapsed: every retention node_gone, the
    node out of the routers' lists, while another replica was healthy all along."""
    other = await make_daemon(etcd=daemon.settings.etcd)  # a second replica, same etcd
    proxy = HangingProxy(daemon.address)
    try:
        hung = await proxy.start()
        d = await start_emulator(role="decode")
        s = sidecar_settings(d, daemon, daemon__liveness_ttl_s=TTL_S)
        s = replace(s, daemon=replace(s.daemon, addresses=(hung, other.address)))
        cb = connect(other)  # type: ignore[operator]
        async with Sidecar(s) as sc:
            node_id = sc.settings.node_id
            await eventually(lambda: _alive_at(cb, node_id, 1))
            # Registration is visible before the Attach stream is up: wait for both.
            await eventually(lambda: _counted(sc, "kvferry_sidecar_attaches_total", outcome="ok"))
            proxy.hang()
            loop = asyncio.get_running_loop()
            until = loop.time() + 2 * TTL_S  # two liveness TTLs
            while loop.time() < until:  # (alive at every look, through the failover)
                assert await _alive_at(cb, node_id, 1), "the node lapsed while a replica was healthy"
                await asyncio.sleep(0.1)
            assert sc.metrics.value("kvferry_sidecar_attaches_total", outcome="lost") == 1
            assert sc.metrics.value("kvferry_sidecar_attaches_total", outcome="ok") == 2
    finally:
        await proxy.close()

"""A control-plane outage never becomes a client error: the router keeps routing to the
nodes it knew while their engines answer its own /health probes, and drops a node whose
engine stops answering, whatever the daemon says or cannot say."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import grpc
import pytest

from kvferry.tasks import cancel_and_wait
from kvferry.v1 import nodes_pb2
from router.nodes import NodeDirectory
from tests.conftest import DaemonFactory, EtcdProcess, daemon_settings
from tests.polling import eventually
from tests.router.conftest import MakeStack
from tests.router.helpers import ask, first_turn, next_turn

#: The nodes' liveness TTL in these tests (tests.router.conftest.sidecar_for).
LIVENESS_TTL_S = 10.0


@contextlib.contextmanager
def stalled(etcd: EtcdProcess) -> Iterator[None]:
    """etcd frozen (SIGSTOP): it keeps its connections and answers nothing."""
    proc = etcd.etcd._proc
    assert proc is not None and proc.returncode is None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


class Gate:
    """A TCP proxy to `target` whose traffic can be held: its connections stay open and
    nothing passes them (a hung daemon, as its clients see it) until it is let through."""

    def __init__(self, target: str) -> None:
        self._target = target
        self.open = asyncio.Event()
        self.open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self._target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps)
        self._tasks.difference_update(pumps)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self.open.wait()
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        self.open.set()
        if self._server is not None:
            self._server.close()
        await cancel_and_wait(list(self._tasks))


@pytest.fixture
async def gates() -> AsyncIterator[Callable[[str], Awaitable[Gate]]]:
    """Gates to addresses; closed after everything else the test started (set up first)."""
    made: list[Gate] = []

    async def make(target: str) -> Gate:
        gate = Gate(target)
        await gate.start()
        made.append(gate)
        return gate

    yield make
    for gate in made:
        await gate.close()


class Refreshes:
    """Counts the refreshes of a router's node list (its directory's `refresh`, wrapped)."""

    def __init__(self, directory: NodeDirectory) -> None:
        self.count = 0
        refresh = directory.refresh

        async def counted_refresh() -> None:
            await refresh()
            self.count += 1

        directory.refresh = counted_refresh  # type: ignore[method-assign]

    async def wait(self, times: int) -> None:
        """Until the router has refreshed its node list `times` more times."""
        until = self.count + times

        async def done() -> bool:
            return self.count >= until

        await eventually(done, within=20)


async def _turns_until(
    done: asyncio.Event, http: aiohttp.ClientSession, url: str, topic: str, statuses: dict[int, int]
) -> None:
    """Turns of conversation `topic` one after another until `done`; `statuses` counts each
    answer's status."""
    messages = first_turn(topic)
    while not done.is_set():
        res = await ask(http, url, {"messages": messages, "max_tokens": 4, "conversation_id": topic})
        statuses[res.status] = statuses.get(res.status, 0) + 1
        messages = next_turn(messages, res.text)[-3:] if res.status == 200 else messages


async def test_a_control_plane_outage_longer_than_the_liveness_ttl_costs_no_turn(
    gates: Callable[[str], Awaitable[Gate]],
    private_etcd: EtcdProcess,
    make_daemon: DaemonFactory,
    make_stack: MakeStack,
    http: aiohttp.ClientSession,
) -> None:
    """etcd stalls, and the daemon hangs for the sidecars, past the nodes' liveness TTL: their
    leases lapse, and once etcd answers again the daemon lists every node as not alive
    until its sidecar gets through again. The router emptied its node list then, and
    answered 503 for as long (8-9 s on real vLLM) while every engine was healthy. Now it
    keeps the nodes it knew while they answer its own probes: every turn is served."""
    daemon = await make_daemon(daemon_settings(private_etcd.endpoint))
    gate = await gates(daemon.address)
    stack = await make_stack(daemon=daemon, sidecar_daemon=gate.address)
    router = await stack.router()
    directory = router.directory
    assert directory is not None
    refreshes = Refreshes(directory)

    async def listed(alive: bool) -> bool:
        try:
            res = await stack.client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True), timeout=2)
        except grpc.aio.AioRpcError:  # (the daemon reconnecting to etcd)
            return False
        return len(res.nodes) == 2 and all(n.alive == alive for n in res.nodes)

    statuses: dict[int, int] = {}
    done = asyncio.Event()
    serving = [
        asyncio.create_task(_turns_until(done, http, router.url, f"outage {i}", statuses)) for i in range(2)
    ]
    try:
        gate.open.clear()
        with stalled(private_etcd):
            await asyncio.sleep(LIVENESS_TTL_S + 1.0)  # (the outage itself: nothing to wait on)
        # etcd answers again; the sidecars do not get through yet: the nodes are listed lapsed.
        await eventually(lambda: listed(alive=False), within=10)
        await refreshes.wait(3)
        kept_lapsed = router.metrics.value("kvferry_router_nodes_lapsed")
        gate.open.set()
        await eventually(lambda: listed(alive=True), within=20)
        await refreshes.wait(2)
    finally:
        done.set()
        await asyncio.gather(*serving)
    assert set(statuses) == {200} and sum(statuses.values()) > 10, statuses
    assert kept_lapsed == 2  # (the outage was as described: the nodes listed lapsed, and kept)
    assert router.metrics.value("kvferry_router_nodes_lapsed") == 0
    assert len(directory.nodes) == 2


async def test_a_node_whose_engine_fails_its_health_is_dropped_while_the_daemon_is_down(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """The daemon is gone, so its list cannot change; one D's engine dies behind its live
    sidecar (which answers /health 502). The router's own probes drop that D: the turns
    go to the other one, none to the dead engine."""
    stack = await make_stack(decode=2)
    router = await stack.router(upstream__health_interval_s=0.1, upstream__health_failures=2)
    directory = router.directory
    assert directory is not None
    dead = stack.decodes[0]
    [dead_id] = [n.engine_id for n in directory.nodes if n.url == stack.sidecar(dead).url]
    await stack.daemon.stop()
    await dead.stop()

    async def dropped() -> bool:
        return dead_id not in {n.engine_id for n in directory.nodes}

    t0 = time.monotonic()
    await eventually(dropped, within=10)
    assert time.monotonic() - t0 < 5
    assert router.metrics.value("kvferry_router_nodes_failing") == 1
    assert router.metrics.value("kvferry_router_nodes", role="decode") == 1

    def decode_errors() -> float:
        name = "kvferry_router_upstream_errors_total"
        return sum(router.metrics.value(name, role="decode", kind=k) for k in ("connect", "status_5xx"))

    before = decode_errors()
    for i in range(6):
        body = {"messages": first_turn(f"left {i}"), "max_tokens": 4, "conversation_id": f"left-{i}"}
        res = await ask(http, router.url, body)
        assert res.status == 200, res.body
    assert decode_errors() == before  # none went to the dead engine's sidecar

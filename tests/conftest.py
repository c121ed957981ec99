"""Shared fixtures: a real etcd (started here, or named by KVFERRY_TEST_ETCD), real
daemons on port 0, real gRPC channels. Every test gets its own key prefix."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp.web_app
import grpc
import hypothesis
import pytest

from controlplane.daemon import Daemon
from controlplane.embedded import EmbeddedEtcd
from controlplane.settings import EtcdSettings, GcSettings, NodeSettings, ServerSettings, Settings
from emulator import EmulatorServer
from kvferry.v1 import leases_pb2_grpc, nodes_pb2_grpc
from realvllm.process import free_port
from tests.emulator.helpers import config as emulator_config
from tests.history.harness import SUMMARIES

# No per-example deadline: one example stalled by a full GC or a lost CPU on a loaded 2-core
# machine, then fast when replayed, is reported as a flaky failure, never a finding.
hypothesis.settings.register_profile(
    "kvferry", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("kvferry")

# (a private name of aiohttp's: no_retained_apps does nothing if a release renames it)
_middleware_cache = getattr(aiohttp.web_app, "_cached_build_middleware", None)


# Releases send no ticks in the tests (kvferry.releases reads this when first imported, as
# do the CLI's processes; nothing imported above imports it): the emulator's notifications
# are never deferred, and a tick is one more request each fake engine would have to tell
# apart. The real-vLLM scenarios keep them (tests/scenarios/backends.py).
if os.environ.get("KVFERRY_ENGINES") != "vllm":
    os.environ.setdefault("KVFERRY_RELEASE_TICKS_S", "")


class EtcdProcess:
    """A real etcd server on loopback that a test may stop and start again."""

    def __init__(self, data_dir: Path) -> None:
        self.etcd = EmbeddedEtcd(data_dir, free_port(), free_port(), name=f"t{uuid.uuid4().hex[:6]}")

    @property
    def endpoint(self) -> str:
        return self.etcd.endpoint

    async def start(self) -> None:
        await self.etcd.start()
        await wait_port(self.etcd.client_port)

    async def stop(self) -> None:
        await self.etcd.stop()


async def wait_port(port: int, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            await w.wait_closed()
            return
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One etcd for the session; tests isolate by key prefix."""
    external = os.environ.get("KVFERRY_TEST_ETCD")
    if external:
        yield external
        return
    etcd = EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data", free_port(), free_port())
    etcd.data_dir.mkdir(parents=True)
    with open(etcd.log_path, "ab") as out:
        proc = subprocess.Popen(etcd.command(), stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", etcd.client_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"etcd did not start; see {etcd.log_path}") from None
                time.sleep(0.05)
        yield etcd.endpoint
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def private_etcd(tmp_path: Path) -> AsyncIterator[EtcdProcess]:
    """An etcd of this test's own, for tests that stop it."""
    proc = EtcdProcess(tmp_path / "etcd")
    await proc.start()
    yield proc
    await proc.stop()


def daemon_settings(endpoint: str, prefix: str | None = None, **changes: object) -> Settings:
    s = Settings(
        # (3 s per etcd request: one session etcd serves every test, and on a loaded 2-core
        # machine it has stalled past 1 s, failing a test's first Register)
        etcd=EtcdSettings(
            endpoints=(endpoint,), prefix=prefix or f"/t-{uuid.uuid4().hex[:10]}", timeout_s=3.0
        ),
        server=ServerSettings(listen="127.0.0.1:0", metrics_port=-1, grace_s=0.5),
        nodes=NodeSettings(liveness_ttl_s=10, cache_refresh_s=0.2),
        gc=GcSettings(gauge_scan_s=0),
    )
    return replace(s, **changes)  # type: ignore[arg-type]


def owning(settings: Settings, **changes: Any) -> Settings:
    """`settings` with these OwnerSettings changed."""
    return replace(settings, owners=replace(settings.owners, **changes))


DaemonFactory = Callable[..., Awaitable[Daemon]]
StartEmulator = Callable[..., Awaitable[EmulatorServer]]


@pytest.fixture
async def start_emulator() -> AsyncIterator[StartEmulator]:
    """Start emulated engines (EmulatorConfig fields as keywords); all stop at teardown."""
    started: list[EmulatorServer] = []

    async def start(**changes: Any) -> EmulatorServer:
        emu = EmulatorServer(emulator_config(**changes), shutdown_timeout=0.5)
        await emu.start()
        started.append(emu)
        return emu

    yield start
    for emu in reversed(started):
        await asyncio.wait_for(emu.stop(), timeout=10)


@pytest.fixture
async def make_daemon(etcd_endpoint: str) -> AsyncIterator[DaemonFactory]:
    started: list[Daemon] = []

    async def make(settings: Settings | None = None, **changes: object) -> Daemon:
        d = Daemon(settings or daemon_settings(etcd_endpoint, **changes))
        await d.start()
        started.append(d)
        return d

    yield make
    for d in started:
        await d.stop()


@pytest.fixture
async def daemon(make_daemon: DaemonFactory) -> Daemon:
    return await make_daemon()


class Client:
    """Stubs for one daemon over one real channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.leases = leases_pb2_grpc.LeasesStub(self.channel)
        self.nodes = nodes_pb2_grpc.NodesStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[Daemon], Client]]:
    clients: list[Client] = []

    def make(d: Daemon) -> Client:
        c = Client(d.address)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


@pytest.fixture
async def client(daemon: Daemon, connect: Callable[[Daemon], Client]) -> Client:
    return connect(daemon)


@pytest.fixture(autouse=True)
def no_retained_apps() -> Iterator[None]:
    """Let the aiohttp applications a test served go when it ends.

    aiohttp builds each handler's middleware chain once and keeps it in a process-wide
    cache of up to 1,024 entries (`aiohttp.web_app._cached_build_middleware`), each
    holding the handler and its Application: every engine, router and sidecar a test
    started stayed alive for the rest of the session, block pools and all (a million
    objects after 14 router tests, 340 MiB). Every full collection walked them, and so
    did the interpreter's last ones after the summary, which is where pytest lingered
    before exiting (4 s after tests/router here; minutes on a busy machine). The engines'
    gRPC channels kept gRPC up as well, and its exit handler waited 2 s for it. (A
    process serving one application, as each of ours does in production, keeps one set.)"""
    yield
    if _middleware_cache is not None:
        _middleware_cache.cache_clear()


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running on its loop."""
    before = asyncio.all_tasks()
    yield

    def leftovers() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]

    # gRPC's own per-RPC tasks end a few loop turns after server.stop() returns.
    for _ in range(50):
        if not leftovers():
            return
        await asyncio.sleep(0.02)
    assert not leftovers(), f"leaked tasks: {leftovers()}"


class FakeCompletions:
    """An HTTP server answering /v1/completions with `status` (an engine taking releases:
    400, the refusal that carries one, `kvferry.releases`); `got` holds each request's JSON
    body and Authorization header."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, Any], str | None]] = []
        self.status = 400
        self.url = ""


@contextlib.asynccontextmanager
async def fake_completions() -> AsyncIterator[FakeCompletions]:
    from aiohttp import web

    fake = FakeCompletions()

    async def completions(request: web.Request) -> web.Response:
        fake.got.append((await request.json(), request.headers.get("Authorization")))
        return web.json_response(
            {} if fake.status == 200 else {"error": {"message": "no"}}, status=fake.status
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serve_app(app) as fake.url:
        yield fake


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """An aiohttp application served on a loopback port picked by the kernel. -> its URL."""
    from aiohttp import web

    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# -- the single-use history checks' lines in the terminal summary -------------------------------
# A checked history's line (tests.history.harness.SUMMARIES) goes with its test's report, so
# that it reaches the summary from a pytest-xdist worker too (`make test` runs two): the
# summary is printed by the process that reports, which collects no test of its own.

_HISTORY = "single-use history check"
_HISTORY_LINES: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when == "call" and SUMMARIES:
        outcome.get_result().user_properties.extend((_HISTORY, line) for line in SUMMARIES)
        SUMMARIES.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _HISTORY_LINES.extend(str(v) for k, v in report.user_properties if k == _HISTORY)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _HISTORY_LINES:
        terminalreporter.section(_HISTORY)
        for line in _HISTORY_LINES:
            terminalreporter.write_line(line)

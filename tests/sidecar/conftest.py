"""Fixtures of the sidecar tests: emulated engines, sidecars in front of them, one HTTP session.

Everything is real and on loopback: the daemon (root conftest) on a real etcd,
emulators with their HTTP server, side channel and ZMQ publisher, sidecars with
their tap. Ports are picked at runtime.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from controlplane.daemon import Daemon
from emulator import EmulatorServer
from sidecar import Settings, Sidecar
from sidecar.settings import DaemonSettings, EngineSettings, KvEventSettings, TapSettings
from tests.conftest import StartEmulator

__all__ = ["EchoEngine", "StartEmulator", "StartSidecar", "StartTap", "sidecar_settings"]

StartSidecar = Callable[..., Awaitable[Sidecar]]


def sidecar_settings(emu: EmulatorServer, daemon: Daemon, **changes: Any) -> Settings:
    """A sidecar in front of `emu`, talking to `daemon`, with short timings for tests.

    Keywords replace fields of the settings groups: ``engine__role="both"``,
    ``daemon__liveness_ttl_s=2`` ...
    """
    s = Settings(
        engine=EngineSettings(
            url=emu.http_url,
            engine_id=f"node-{emu.http_port}",
            role="decode",
            side_channel_host="127.0.0.1",
            side_channel_port=emu.side_channel_port,
            health_interval_s=0.1,
            health_timeout_s=1.0,
            health_failures=2,
        ),
        kv_events=KvEventSettings(
            endpoint=emu.kv_events_endpoint or "",
            replay_endpoint=emu.kv_events_replay_endpoint or "",
            topic=emu.config.kv_events_topic,
            replay_timeout_s=1.0,
        ),
        daemon=DaemonSettings(addresses=(daemon.address,), liveness_ttl_s=10, backoff_max_s=0.5),
        tap=TapSettings(listen="127.0.0.1:0"),
    )
    groups: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        group, _, name = key.partition("__")
        groups.setdefault(group, {})[name] = value
    return replace(s, **{g: replace(getattr(s, g), **fields) for g, fields in groups.items()})


@pytest.fixture
async def start_sidecar(daemon: Daemon) -> AsyncIterator[StartSidecar]:
    """Start sidecars (`sidecar_settings` keywords); all are stopped at teardown."""
    started: list[Sidecar] = []

    async def start(emu: EmulatorServer, against: Daemon | None = None, **changes: Any) -> Sidecar:
        sc = Sidecar(sidecar_settings(emu, against or daemon, **changes))
        await sc.start()
        started.append(sc)
        return sc

    yield start
    for sc in reversed(started):
        await asyncio.wait_for(sc.stop(), timeout=10)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@dataclass
class EchoEngine:
    """A stand-in engine that answers with what it received (a test double for raw proxying)."""

    url: str = ""
    seen: list[str] = field(default_factory=list)
    """Method and path (with query) of every request, in order, but the sidecar's own
    probes (/health, GET /metrics and /v1/models)."""


@pytest.fixture
async def echo() -> AsyncIterator[EchoEngine]:
    engine = EchoEngine()

    async def answer(request: web.Request) -> web.Response:
        seen = f"{request.method} {request.path_qs}"
        if seen not in ("GET /metrics", "GET /v1/models"):
            engine.seen.append(seen)
        return web.json_response(
            {
                "method": request.method,
                "path_qs": request.path_qs,
                "headers": dict(request.headers),
                "body": (await request.read()).decode(),
            },
            headers={"X-Engine": "echo"},
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield engine
    await runner.cleanup()


@pytest.fixture
def echo_engine(echo: EchoEngine) -> str:
    """The URL of an `EchoEngine`."""
    return echo.url


StartTap = Callable[..., Awaitable[Sidecar]]
"""Starts a sidecar in front of the echo engine."""


@pytest.fixture
async def start_tap(
    echo: EchoEngine, daemon: Daemon, start_emulator: StartEmulator
) -> AsyncIterator[StartTap]:
    """Sidecars in front of the echo engine (keywords: `sidecar_settings`'s)."""
    emu = await start_emulator()  # (the settings' ports)
    started: list[Sidecar] = []

    async def start(**changes: Any) -> Sidecar:
        sc = Sidecar(sidecar_settings(emu, daemon, engine__url=echo.url, engine__model="m", **changes))
        await sc.start()
        started.append(sc)
        return sc

    yield start
    for sc in started:
        await sc.stop()

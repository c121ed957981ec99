"""Fixtures of the scenario suite: the session's engines (see backends.py) and, per test,
a kvferry deployment in front of them: a real daemon on the session's etcd, a sidecar
for each engine, a router with reuse and one without (the reference answers)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from controlplane.daemon import Daemon
from kvferry.v1 import nodes_pb2
from realvllm.process import free_port
from router import Router
from sidecar import Settings as SidecarSettings
from sidecar import Sidecar
from sidecar.settings import DaemonSettings as SidecarDaemonSettings
from sidecar.settings import EngineSettings, KvEventSettings, TapSettings
from tests.conftest import Client, DaemonFactory
from tests.router.conftest import router_settings
from tests.scenarios.backends import DECODER_TTL_S, Engine, Engines, backend, start_engines

_names = itertools.count()


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """One prefill and one decode engine of the chosen backend, for the whole session."""
    started = start_engines(backend(), tmp_path_factory.mktemp("engines"))
    yield started
    started.stop()


def sidecar_settings(
    engine: Engine, daemon: Daemon, tap_port: int, events_endpoint: str | None = None, **engine_changes: Any
) -> SidecarSettings:
    engine_settings = {
        "url": engine.http_url,
        "engine_id": f"{engine.role}-{urlsplit(engine.http_url).port}",
        "role": engine.role,
        "side_channel_host": engine.side_channel_host,
        "side_channel_port": engine.side_channel_port,
        "health_interval_s": 0.2,
        "health_timeout_s": 2.0,
        "health_failures": 3,
        "blocks_ttl_s": DECODER_TTL_S,
    }
    return SidecarSettings(
        engine=EngineSettings(**{**engine_settings, **engine_changes}),
        kv_events=KvEventSettings(
            endpoint=engine.kv_events_endpoint if events_endpoint is None else events_endpoint,
            replay_endpoint=engine.kv_events_replay_endpoint,
            topic="kvferry",
        ),
        daemon=SidecarDaemonSettings(addresses=(daemon.address,), liveness_ttl_s=10, backoff_max_s=0.3),
        tap=TapSettings(listen=f"127.0.0.1:{tap_port}"),
    )


@dataclass
class Deployment:
    """kvferry in front of the session's engines."""

    engines: Engines
    daemon: Daemon
    client: Client
    http: aiohttp.ClientSession
    sidecars: dict[str, Sidecar] = field(default_factory=dict)
    routers: list[Router] = field(default_factory=list)
    tap_ports: dict[str, int] = field(default_factory=lambda: {"prefill": free_port(), "decode": free_port()})
    """Each role's sidecar listens on one port, restarts included (as a deployment's would)."""

    @property
    def router(self) -> Router:
        """The router with reuse (the first started)."""
        return self.routers[0]

    @property
    def plain(self) -> Router:
        """A router without reuse on the same engines: the reference answers."""
        return self.routers[1]

    async def start_sidecar(
        self, role: str, events_endpoint: str | None = None, **engine_changes: Any
    ) -> Sidecar:
        """A sidecar for the role's engine (`events_endpoint`: another KV-event PUB to follow;
        `engine_changes`: fields of its EngineSettings)."""
        engine = self.engines.prefill if role == "prefill" else self.engines.decode
        sc = Sidecar(
            sidecar_settings(engine, self.daemon, self.tap_ports[role], events_endpoint, **engine_changes)
        )
        await sc.start()
        self.sidecars[role] = sc
        return sc

    async def stop_sidecar(self, role: str) -> None:
        sc = self.sidecars.pop(role)
        await asyncio.wait_for(sc.stop(), 10)

    async def wait_nodes(self, timeout_s: float = 30.0) -> None:
        """Until every sidecar's node is alive at the daemon."""
        want = {sc.settings.node_id for sc in self.sidecars.values()}
        async with asyncio.timeout(timeout_s):
            while True:
                listed = await self.client.nodes.List(nodes_pb2.ListNodesRequest())
                if want <= {n.engine_id for n in listed.nodes if n.alive}:
                    return
                await asyncio.sleep(0.05)

    async def wait_routable(self, timeout_s: float = 60.0) -> None:
        """Until every router routes to every sidecar's node (after an engine came back, its
        probes have to see it answer again)."""
        want = {sc.settings.node_id for sc in self.sidecars.values()}
        async with asyncio.timeout(timeout_s):
            for r in self.routers:
                assert r.directory is not None
                while True:
                    if want <= {n.engine_id for n in r.directory.view.nodes}:
                        break
                    await asyncio.sleep(0.05)

    async def start_router(self, **changes: Any) -> Router:
        await self.wait_nodes()
        r = Router(router_settings(self.daemon, **changes))
        await r.start()
        self.routers.append(r)
        return r

    async def registrations_idle(self, timeout_s: float = 60.0) -> None:
        """Until D's sidecar has sent every registration it captured."""
        sender = self.sidecars["decode"].retentions
        assert sender is not None
        async with asyncio.timeout(timeout_s):
            while sender.pending:
                await sender.wait_idle(timeout_s)

    def conversation(self, topic: str) -> str:
        """A conversation id no other test or run uses."""
        return f"{topic}-{next(_names)}-{id(self):x}"

    async def close(self) -> None:
        for r in reversed(self.routers):
            await asyncio.wait_for(r.stop(), 10)
        for sc in reversed(list(self.sidecars.values())):
            await asyncio.wait_for(sc.stop(), 10)
        await asyncio.sleep(0.1)  # the daemon's Attach handlers see their streams end


@pytest.fixture
async def deployment(engines: Engines, make_daemon: DaemonFactory, connect: Any) -> AsyncIterator[Deployment]:
    daemon = await make_daemon()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        dep = Deployment(engines, daemon, connect(daemon), http)
        try:
            await dep.start_sidecar("prefill")
            await dep.start_sidecar("decode")
            await dep.start_router()
            await dep.start_router(reuse__enabled=False)
            yield dep
        finally:
            await dep.close()

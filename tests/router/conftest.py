"""Fixtures of the router tests: a whole P/D deployment on loopback.

A `Stack` is a real daemon (root conftest, real etcd), emulated engines with a
sidecar each (prefill nodes with prefix caching off, as in the published
measurement), and routers started on demand. Every port is picked at runtime.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest

from controlplane.daemon import Daemon
from emulator import EmulatorConfig, EmulatorServer
from kvferry.v1 import nodes_pb2
from router import Router
from router import Settings as RouterSettings
from router.settings import DaemonSettings, ServerSettings
from sidecar import Settings as SidecarSettings
from sidecar import Sidecar
from sidecar.settings import DaemonSettings as SidecarDaemonSettings
from sidecar.settings import EngineSettings, KvEventSettings, TapSettings
from tests.conftest import Client, DaemonFactory
from tests.router.helpers import Result, ask, first_turn

MODEL = "kvferry/emulated-model"


def emulator_config(**changes: Any) -> EmulatorConfig:
    base = EmulatorConfig(
        host="127.0.0.1",
        port=0,
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        kv_events_host="127.0.0.1",
        max_model_len=32768,
        num_blocks=8192,
    )
    return base.replace(**changes)


def sidecar_for(
    emu: EmulatorServer, daemon: Daemon, role: str, advertise_engine_url: str = "", daemon_address: str = ""
) -> SidecarSettings:
    """A sidecar's settings for `emu`, on `daemon` (at `daemon_address` when given: a proxy;
    registering over its framed stream when it serves one)."""
    framed = (f"127.0.0.1:{daemon.stream_port}",) if daemon.stream_port and not daemon_address else ()
    return SidecarSettings(
        engine=EngineSettings(
            url=emu.http_url,
            engine_id=f"{role}-{emu.http_port}",
            role=role,
            side_channel_host="127.0.0.1",
            side_channel_port=emu.side_channel_port,
            health_interval_s=0.1,
            health_timeout_s=1.0,
            health_failures=2,
        ),
        kv_events=KvEventSettings(
            endpoint=emu.kv_events_endpoint or "",
            replay_endpoint=emu.kv_events_replay_endpoint or "",
        ),
        daemon=SidecarDaemonSettings(
            addresses=(daemon_address or daemon.address,),
            stream_addresses=framed,
            liveness_ttl_s=10,
            backoff_max_s=0.3,
        ),
        tap=TapSettings(listen="127.0.0.1:0", advertise_engine_url=advertise_engine_url),
    )


def router_settings(daemon: Daemon | None, **changes: Any) -> RouterSettings:
    """A router on port 0 with test timings; keywords replace fields of the groups
    (``daemon__lookup_deadline_s=1.0``, ``reuse__enabled=False``, ...)."""
    s = RouterSettings(
        server=ServerSettings(listen="127.0.0.1:0", shutdown_grace_s=1.0),
        daemon=DaemonSettings(
            addresses=(daemon.address,) if daemon else (),
            lookup_deadline_s=1.0,  # one loop runs the whole deployment here; production: 50 ms
            score_deadline_s=1.0,
            nodes_refresh_s=0.2,
        ),
    )
    groups: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        group, _, name = key.partition("__")
        groups.setdefault(group, {})[name] = value
    return replace(s, **{g: replace(getattr(s, g), **fields) for g, fields in groups.items()})


@dataclass
class Stack:
    """One deployment: daemon, engines with sidecars, routers."""

    daemon: Daemon
    client: Client
    prefills: list[EmulatorServer] = field(default_factory=list)
    decodes: list[EmulatorServer] = field(default_factory=list)
    sidecars: dict[int, Sidecar] = field(default_factory=dict)
    routers: list[Router] = field(default_factory=list)
    sidecar_daemon: str = ""
    """The daemon's address as the sidecars reach it ("" = its own)."""

    def sidecar(self, emu: EmulatorServer) -> Sidecar:
        return self.sidecars[id(emu)]

    async def add_engine(self, role: str, advertise_engine_url: str = "", **config: Any) -> EmulatorServer:
        if role == "prefill":
            config.setdefault("enable_prefix_caching", False)
        emu = EmulatorServer(emulator_config(role=role, **config), shutdown_timeout=0.5)
        await emu.start()
        (self.prefills if role == "prefill" else self.decodes).append(emu)
        sc = Sidecar(sidecar_for(emu, self.daemon, role, advertise_engine_url, self.sidecar_daemon))
        await sc.start()
        self.sidecars[id(emu)] = sc
        return emu

    async def wait_nodes(self, timeout_s: float = 10.0) -> None:
        """Until every sidecar's node is alive at the daemon."""
        want = {sc.settings.node_id for sc in self.sidecars.values()}
        async with asyncio.timeout(timeout_s):
            while True:
                listed = await self.client.nodes.List(nodes_pb2.ListNodesRequest())
                if want <= {n.engine_id for n in listed.nodes if n.alive}:
                    return
                await asyncio.sleep(0.05)

    async def router(self, **changes: Any) -> Router:
        await self.wait_nodes()
        r = Router(router_settings(self.daemon, **changes))
        await r.start()
        self.routers.append(r)
        return r

    async def registrations_idle(self, timeout_s: float = 5.0) -> None:
        """Until every D sidecar has sent its queued retention registrations."""
        async with asyncio.timeout(timeout_s):
            for emu in self.decodes:
                sender = self.sidecar(emu).retentions
                assert sender is not None
                while sender.pending:
                    await sender.wait_idle(timeout_s)

    async def close(self) -> None:
        engines = [*self.decodes, *self.prefills]
        faults = sum(e.engine.metrics.total("kvferry_emulator:connector_faults") for e in engines)
        for r in reversed(self.routers):
            await asyncio.wait_for(r.stop(), 10)
        for sc in reversed(list(self.sidecars.values())):
            await asyncio.wait_for(sc.stop(), 10)
        for emu in engines:
            await asyncio.wait_for(emu.stop(), 10)
        # Let the daemon's Attach handlers see their streams end before the daemon stops
        # (otherwise grpc may leave the handler task pending past the server's stop).
        await asyncio.sleep(0.1)
        # A handout with fewer remote blocks than its tokens need kills a vLLM engine (an
        # assert in its connector); the emulator only fails the request, so say it here.
        assert faults == 0, f"{faults:.0f} handouts a vLLM engine would have died on"


MakeStack = Callable[..., Awaitable[Stack]]
Reference = Callable[[str, dict[str, Any]], Awaitable[str]]
"""The `reference` fixture: (path, body) -> the answer one engine computing it all gives."""


@pytest.fixture
async def make_stack(
    make_daemon: DaemonFactory, connect: Callable[[Daemon], Client]
) -> AsyncIterator[MakeStack]:
    """Start a deployment: `prefill` and `decode` engines (emulator config as `p_config`/`d_config`;
    `p_engine_url` is the P sidecars' advertise_engine_url; `sidecar_daemon` the daemon's
    address as the sidecars reach it)."""
    stacks: list[Stack] = []

    async def make(
        prefill: int = 1,
        decode: int = 1,
        p_config: dict[str, Any] | None = None,
        d_config: dict[str, Any] | None = None,
        daemon: Daemon | None = None,
        p_engine_url: str = "",
        sidecar_daemon: str = "",
    ) -> Stack:
        d = daemon or await make_daemon()
        stack = Stack(d, connect(d), sidecar_daemon=sidecar_daemon)
        stacks.append(stack)
        for _ in range(prefill):
            await stack.add_engine("prefill", p_engine_url, **(p_config or {}))
        for _ in range(decode):
            await stack.add_engine("decode", **(d_config or {}))
        return stack

    yield make
    for s in reversed(stacks):
        await s.close()


async def one_turn_held(
    make_stack: MakeStack, http: aiohttp.ClientSession, topic: str, conversation: str
) -> tuple[Stack, Any, dict[str, Any], Result, str]:
    """A deployment with one router, and a first turn of `conversation` whose blocks D holds:
    -> (the stack, D, the turn's body, its answer, D's request id of the held blocks)."""
    stack = await make_stack()
    router = await stack.router()
    [d] = stack.decodes
    body = {"messages": first_turn(topic), "max_tokens": 10, "conversation_id": conversation}
    one = await ask(http, router.url, body)
    assert one.status == 200
    await stack.registrations_idle()
    [first] = d.engine.snapshot()["held_requests"]
    return stack, d, body, one, first


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
async def reference(http: aiohttp.ClientSession) -> AsyncIterator[Reference]:
    """The answer a single engine computing everything itself gives (the no-reuse answer)."""
    emu = EmulatorServer(emulator_config(num_blocks=16384), shutdown_timeout=0.5)
    await emu.start()

    async def answer(path: str, body: dict[str, Any]) -> str:
        fields = {k: v for k, v in body.items() if k not in ("conversation_id", "stream", "stream_options")}
        async with http.post(emu.http_url + path, json=fields) as r:
            assert r.status == 200, await r.text()
            return text_of(await r.json())

    yield answer
    await emu.stop()


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])

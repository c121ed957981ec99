"""One sidecar, in-process: ``async with Sidecar(settings) as sc: ... sc.url ...``.

With TLS (`sidecar.settings.SecuritySettings`) the tap serves HTTPS, asking clients for
a certificate, and the sidecar presents its own to the daemon and to other nodes; a
`CertReloader` loads rotated files into both SSL contexts. With a policy the tap's gate
checks every caller (`sidecar.access`).

Starts the tap (HTTP), the health watch, the node session (Register + Attach),
the retention sender and, when configured, the KV-event ingest; `stop` shuts
the tap down (in-flight answers get the runner's grace), gives queued retention
registrations a moment to go out, then cancels and awaits every task and
closes every socket and channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import structlog
import zmq.asyncio

from kvferry.hops import KEEPALIVE_S
from kvferry.security.policy import Policy, load_policy
from kvferry.security.tls import CertReloader, TlsFiles, client_ssl_context, server_ssl_context
from kvferry.serving import LINGER_S, Deadlines, GuardedServer
from kvferry.tasks import cancel_and_wait
from kvferry.urls import local_address
from sidecar.daemon import DaemonLink
from sidecar.engine import EngineInstance, watch_health
from sidecar.kvindex import KvMirror
from sidecar.kvstream import KvIngest
from sidecar.metrics import SidecarMetrics
from sidecar.node import NodeSession
from sidecar.releases import Releaser
from sidecar.retentions import RetentionSender
from sidecar.settings import Settings, listen_address
from sidecar.tap import Tap
from sidecar.unretained import UnretainedLedger

log = structlog.get_logger(__name__)


#: Pause before a component that failed unexpectedly is started again.
RESTART_DELAY_S = 1.0


@dataclass(frozen=True)
class Security:
    """The TLS files and the policy a sidecar runs with, read (None, None: development mode)."""

    tls: TlsFiles | None
    policy: Policy | None


def load_security(s: Settings) -> Security:
    """Read the TLS files and the policy file the settings name; ValueError saying what is wrong."""
    sec = s.security
    named = sec.tls_files
    tls = None if named is None else TlsFiles.from_flags(named.ca, named.cert, named.key)
    policy = load_policy(Path(sec.policy)) if sec.policy else None
    return Security(tls, policy)


async def _supervise(run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
    """Run a component forever: one that fails on a bug is logged and started again."""
    while True:
        try:
            await run()
            return
        except Exception:
            log.exception("sidecar.task.crashed", task=name)
        await asyncio.sleep(RESTART_DELAY_S)


class Sidecar:
    """A running sidecar; `start()` then `stop()`, or `async with`."""

    def __init__(self, settings: Settings) -> None:
        settings.validate()
        self.settings = settings
        self.metrics = SidecarMetrics()
        self.instance = EngineInstance(self.metrics, settings.engine.health_failures)
        self.mirror = KvMirror(settings.kv_events.ranks)
        self.unretained = UnretainedLedger(settings.engine.blocks_ttl_s)
        """Blocks the engine pins for turns no retention names (see sidecar.unretained)."""
        self.instance.on_restart(lambda: self.unretained.restart(self.instance.epoch))
        self.metrics.unretained_blocks.set_function(lambda: self.unretained.blocks(time.monotonic()))
        self.port = 0
        self.security = load_security(settings)
        d = settings.daemon
        self._link = DaemonLink(d.addresses, self.security.tls, d.stream_addresses)
        self.reloader: CertReloader | None = None
        """Loads rotated TLS files into the tap's and the client's contexts (None: no TLS)."""
        self._http: aiohttp.ClientSession | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._server: GuardedServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.retentions: RetentionSender | None = None
        self._releaser: Releaser | None = None
        self.node: NodeSession | None = None
        self.tap: Tap | None = None

    @property
    def url(self) -> str:
        """Base URL of the tap, e.g. ``http://127.0.0.1:PORT`` (https with TLS)."""
        return f"{self.settings.scheme}://{local_address(self.settings.tap.listen, self.port)}"

    async def start(self) -> None:
        s = self.settings
        try:
            server_ssl, client_ssl = self._ssl_contexts()
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, ttl_dns_cache=60, keepalive_timeout=KEEPALIVE_S, ssl=client_ssl or True
                ),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.tap.connect_timeout_s),
                auto_decompress=False,
            )
            self._releaser = Releaser(s, self._link, self._http, self.metrics)
            self.retentions = RetentionSender(
                s, self.instance, self._link, self.metrics, self._releaser, self.unretained
            )
            self.node = NodeSession(
                s,
                self.instance,
                self.mirror,
                self._link,
                self._http,
                self.metrics,
                self.unretained,
                self._releaser,
            )
            tap = self.tap = Tap(
                s, self._http, self.instance, self.retentions, self.metrics, self.unretained, self._releaser
            )
            host, port = listen_address(s)
            self._server = GuardedServer(
                tap.app(self.security.policy),
                Deadlines(s.tap.head_timeout_s, s.tap.idle_timeout_s),
                shutdown_timeout=2.0,
                auto_decompress=False,  # (sidecar.bodies decodes, with its caps)
                lingering_time=LINGER_S,
            )
            await self._server.start(host, port, server_ssl)
            self.port = self._server.port
            self.node.tap_port = self.port
            http = self._http
            self._spawn(lambda: watch_health(http, s.engine, self.instance), "health")
            self._spawn(self.node.run, "node")
            self._spawn(self.retentions.run, "retentions")
            if s.kv_events.endpoint:
                self._ingest_kv_events(self.node)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "sidecar.started",
            url=self.url,
            engine=s.engine.url,
            engine_id=s.node_id,
            daemon=list(s.daemon.addresses),
            kv_events=s.kv_events.endpoint or None,
        )

    def _ingest_kv_events(self, node: NodeSession) -> None:
        """Follow the engine's KV-event streams (a data-parallel engine: one stream a rank)."""
        s = self.settings
        self._zmq = zmq.asyncio.Context()
        for rank in range(s.kv_events.ranks):
            ingest = KvIngest(
                s.kv_events.for_rank(rank),
                self._zmq,
                self.mirror,
                self.instance,
                self.metrics,
                node.kv_changed,
                rank,
            )
            self._spawn(ingest.run, f"kvevents-{rank}")

    def _ssl_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
        """(the tap's, the client's) SSL contexts, kept up to date by a reloader; None without TLS.

        The tap asks for a client certificate without requiring one at the handshake: the
        gate refuses a caller with neither a certificate nor a token of the policy (401),
        and lets health probes, which carry none, through (`sidecar.access`)."""
        tls = self.security.tls
        if tls is None:
            return None, None
        server = server_ssl_context(tls, require_client_cert=False)
        client = client_ssl_context(tls)
        watched = TlsFiles(tls.ca, tls.cert, tls.key)  # (its own: `changed()` answers each asker once)
        watched.changed()  # (the files as just loaded)
        self.reloader = CertReloader(watched, [server, client])
        self.reloader.start()
        return server, client

    def _spawn(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._tasks.append(asyncio.create_task(_supervise(run, name), name=f"sidecar-{name}"))

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop everything; idempotent. Registrations on their way get `grace_s`, then
        releases on their way as long again."""
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self.retentions is not None and self.retentions.pending and self._tasks:
            await self.retentions.wait_idle(grace_s)
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self.reloader is not None:
            await self.reloader.stop()
            self.reloader = None
        dropped = self.retentions.abandon() if self.retentions is not None else 0
        if dropped:
            log.warning("sidecar.stop.registrations_dropped", count=dropped, grace_s=grace_s)
        if self._releaser is not None:
            with contextlib.suppress(TimeoutError):  # (releases on their way: as long as registrations)
                await asyncio.wait_for(self._releaser.settled(), grace_s)
            await self._releaser.close()
        await self._link.close()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        log.info("sidecar.stopped")

    async def __aenter__(self) -> Sidecar:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

"""One router, in-process: ``async with Router(settings) as r: ... r.url ...``.

Starts the HTTP session to the engines, the daemon client (when addresses are
given), the node directory and its refresh task, and the HTTP server (HTTPS with TLS
files, and a watch that follows their rotation: `router.security`; slow and idle
clients timed out: `kvferry.serving`). `stop`
lets in-flight answers finish (the server's grace), then cancels the refresh
and closes every channel and connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from types import TracebackType

import aiohttp
import structlog

from kvferry.digests import DigestCache
from kvferry.hops import KEEPALIVE_S
from kvferry.serving import LINGER_S, Deadlines, GuardedServer
from kvferry.tasks import cancel_and_wait
from kvferry.urls import listen_host_port, local_address
from router.daemon_client import DaemonClient
from router.http_api import build_app
from router.metrics import RouterMetrics
from router.nodes import DirectRoutes, Load, NodeDirectory
from router.patience import PrefillRates
from router.releases import Releases
from router.security import Security, follow_rotation, load_security
from router.settings import Settings
from router.tokenizer import LocalTokenizer, TokenizerChecks, load_tokenizer
from router.trace import TurnTrace
from router.turn import Shared
from router.upstream import Engines

log = structlog.get_logger(__name__)
#: How long a stop waits for the releases on their way when the grace is spent.
_RELEASES_AT_LEAST_S = 2.0


class Router:
    """A running router; `start()` then `stop()`, or `async with`."""

    def __init__(
        self, settings: Settings, security: Security | None = None, tokenizer: LocalTokenizer | None = None
    ) -> None:
        """`security`: as `load_security` reads it from `settings`; `tokenizer`: as
        `load_tokenizer` does (None: read here; a ValueError says what is wrong with the files)."""
        settings.validate()
        self.settings = settings
        self.security = security if security is not None else load_security(settings)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings)
        self.metrics = RouterMetrics()
        self.port = 0
        self.daemon: DaemonClient | None = None
        self.directory: NodeDirectory | None = None
        self._http: aiohttp.ClientSession | None = None
        self._server: GuardedServer | None = None
        self._refresh: asyncio.Task[None] | None = None
        self._tls_watch: asyncio.Task[None] | None = None
        self._lag: asyncio.Task[None] | None = None
        self._shared: Shared | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT`` (``https://`` with TLS)."""
        return f"{self.security.scheme}://{local_address(self.settings.server.listen, self.port)}"

    async def start(self, nodes_timeout_s: float = 5.0) -> None:
        """Serve; waits up to `nodes_timeout_s` for a first node list (serving 503 until then)."""
        s, sec = self.settings, self.security
        try:
            connector = aiohttp.TCPConnector(
                limit=0,
                ttl_dns_cache=60,
                keepalive_timeout=KEEPALIVE_S,
                ssl=sec.client_ssl if sec.client_ssl is not None else True,
            )
            self._http = aiohttp.ClientSession(connector=connector, auto_decompress=False)
            if s.daemon.addresses:
                self.daemon = DaemonClient(s.daemon.addresses, s.daemon, sec.tls)
            directory = self.directory = NodeDirectory(s, self.daemon, self._http)
            self.metrics.track_nodes(lambda: _node_counts(directory))
            await _first_nodes(directory, nodes_timeout_s)
            if self.daemon is not None and s.reuse.enabled and directory.ready.is_set():
                # (a daemon that did not answer the node list would only add its timeout to
                # the start: then the first turns set the stream up, and the breaker again)
                await self.daemon.open_stream()
            self._refresh = asyncio.create_task(directory.run(), name="router-nodes")
            shared = self._shared = self._make_shared(directory)
            self._lag = asyncio.create_task(shared.lag.run(), name="router-loop-lag")
            self._server = GuardedServer(
                build_app(shared, sec.keys),
                Deadlines(s.server.head_timeout_s, s.server.idle_timeout_s),
                shutdown_timeout=s.server.shutdown_grace_s,
                lingering_time=LINGER_S,  # (after a refusal, what is still sent is read so long)
            )
            host, port = listen_host_port(s.server.listen)
            await self._server.start(host, port, sec.server_ssl)
            self.port = self._server.port
            self._tls_watch = asyncio.create_task(
                follow_rotation(sec, self.daemon, s.security.reload_check_s), name="router-tls"
            )
        except BaseException:
            await self.stop()
            raise
        log.info(
            "router.started",
            url=self.url,
            daemon=list(s.daemon.addresses),
            nodes=[n.engine_id for n in directory.nodes],
            reuse=s.reuse.enabled,
            tokenizer=None if self.tokenizer is None else self.tokenizer.fingerprint,
            tls=sec.tls is not None,
            api_keys=sec.keys.checked,
        )

    def _make_shared(self, directory: NodeDirectory) -> Shared:
        """What every turn uses (the HTTP session and the daemon client made)."""
        s = self.settings
        assert self._http is not None
        return Shared(
            settings=s,
            engines=Engines(self._http, s.upstream),
            directory=directory,
            load=Load(),
            daemon=self.daemon,
            metrics=self.metrics,
            tickets=itertools.count(),
            direct=DirectRoutes(),
            digests=DigestCache(s.reuse.digest_cache_bytes),
            rates=PrefillRates(s.daemon.prefill_s_per_token),
            releases=Releases(s.upstream.max_releases_in_flight),
            trace=TurnTrace(s.server.trace_out) if s.server.trace_out else None,
            tokenizer=self.tokenizer,
            tokenizer_checks=TokenizerChecks(s.upstream.tokenizer_recheck_s),
        )

    async def stop(self) -> None:
        """Stop serving (in-flight answers get the grace), then everything else; idempotent."""
        if self._http is None:  # (nothing started, or stopped already: `start` opens it first)
            return
        deadline = time.monotonic() + self.settings.server.shutdown_grace_s
        if self._server is not None:
            await self._server.close()
            self._server = None
        # What is left of the same grace, and a moment at least (answers cut at the end of
        # the grace release D's blocks): first the lookups still owed an answer (a cut
        # turn's lookup answered late releases what the daemon claimed for it), then the
        # releases on their way.
        until = max(deadline, time.monotonic() + _RELEASES_AT_LEAST_S)
        if self.daemon is not None:
            await self.daemon.owed_answers(until - time.monotonic())
        if self._shared is not None:
            await self._shared.releases.settle(until)
            if self._shared.trace is not None:
                self._shared.trace.close()
        await cancel_and_wait([self._refresh, self._tls_watch, self._lag])
        self._refresh = self._tls_watch = self._lag = None
        if self.daemon is not None:
            await self.daemon.close()
            self.daemon = None
        await self._http.close()
        self._http = None
        log.info("router.stopped", url=self.url)

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def _node_counts(directory: NodeDirectory) -> dict[str, int]:
    """What the node gauges show: nodes routed to per role, lapsed and failing ones."""
    nodes = directory.nodes
    return {
        "prefill": sum(n.prefills for n in nodes),
        "decode": sum(n.decodes for n in nodes),
        "lapsed": len(directory.view.lapsed),
        "failing": len(directory.view.failing),
    }


async def _first_nodes(directory: NodeDirectory, timeout_s: float) -> None:
    """Refresh `directory` until it has nodes to route to, or `timeout_s` is spent."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while True:
                await directory.refresh()
                if directory.ready.is_set():
                    return
                await asyncio.sleep(0.1)

"""The daemon process: embedded or external etcd, the gRPC server, metrics, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from socketserver import BaseRequestHandler
from typing import Any, cast
from wsgiref.simple_server import WSGIServer

import grpc
import structlog
from prometheus_client import start_http_server

from controlplane import metrics, stalls
from controlplane.embedded import SECOND_DAEMON, EmbeddedEtcd, port_free
from controlplane.errors import StoreUnavailable
from controlplane.etcd import EtcdTls
from controlplane.forward import OwnerClient
from controlplane.notices import hold_promises
from controlplane.peers import Peers
from controlplane.records import Keys, OwnerRecord
from controlplane.server import Access, start_server
from controlplane.server.framed import FramedStreams
from controlplane.server.leases import LeasesServicer
from controlplane.service import ControlPlane
from controlplane.service.budgets import Release
from controlplane.settings import Settings
from controlplane.store import EtcdStore
from kvferry.security.tls import CertReloader, TlsFiles, is_loopback, server_ssl_context
from kvferry.tasks import cancel_and_wait
from kvferry.urls import join_host_port, listen_host_port, local_address, split_host_port

log = structlog.get_logger(__name__)

#: Seconds between checks of the TLS files for a rotation.
CERT_CHECK_S = 5.0
#: Seconds a metrics client may take over its TLS handshake and each read of its request.
METRICS_CLIENT_TIMEOUT_S = 10.0


@dataclass
class Daemon:
    """A running daemon; `start()` then `stop()` (or `async with`)."""

    settings: Settings
    port: int = 0
    token_port: int = 0
    metrics_port: int = 0
    control_plane: ControlPlane | None = None
    embedded: EmbeddedEtcd | None = None
    _server: grpc.aio.Server | None = None
    _health: Any = None
    _metrics_httpd: Any = None
    _metrics_reloader: CertReloader | None = None
    _framed_reloader: CertReloader | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _store: EtcdStore | None = None
    peers: Peers | None = None
    _forwarder: OwnerClient | None = None
    _stopped: bool = False
    _framed: FramedStreams | None = None
    stream_port: int = 0
    """The bound port of --stream-listen (0: not served)."""

    @property
    def address(self) -> str:
        """host:port clients reach the gRPC server at."""
        return local_address(self.settings.server.listen, self.port)

    async def start(self) -> None:
        """Start etcd (the embedded one when no endpoints are given), the gRPC server, the
        metrics server and the background loops."""
        t0 = time.perf_counter()
        s = self.settings
        _check_listen_free(s.server.listen)  # (before waiting on an etcd, not after)
        store = await self._open_store()
        cp = ControlPlane(store, s)
        self.control_plane = cp
        metrics.INDEXED_BLOCKS.set_function(cp.attachments.index.total)
        metrics.NODE_VIEW_SOLE.set_function(lambda: float(store.writer.trusted()))
        metrics.NOTICE_PROMISES.set_function(lambda: float(store.promises.promised()))
        with contextlib.suppress(StoreUnavailable):
            await cp.nodes.refresh()
        tls = s.security.tls_files()
        self.peers = Peers(store.replicas, tls=tls)
        access = Access(tls, s.security.access_policy(), s.security.token_listen)
        _warn_open(s, access)
        serving = await start_server(cp, s.server.listen, s.server.max_message_bytes, self.peers, access)
        self._server, self.port, self._health = serving.server, serving.port, serving.health
        self.token_port = serving.token_port
        if s.server.stream_listen:
            await self._serve_framed(serving.leases, access)
        announced = advertised(s.server.listen, self.port, s.server.advertise)
        await self._own(cp, self.peers, announced, tls)
        # Announced even with no address (not asked then): node writes carry the
        # announcement as their fence (controlplane.solewriter).
        self._tasks.append(asyncio.create_task(self.peers.run(announced), name="peers"))
        if not announced:
            log.warning(
                "peers.off",
                listen=s.server.listen,
                why="no address other replicas could reach: give --advertise HOST:PORT",
            )
        self._serve_metrics()
        self._start_loops(cp, store)
        log.info(
            "daemon.serving",
            address=self.address,
            metrics_port=self.metrics_port,
            etcd=list(store.endpoints),
            embedded=self.embedded is not None,
            startup_s=round(time.perf_counter() - t0, 3),
        )

    async def _serve_framed(self, leases: LeasesServicer, access: Access) -> None:
        """Leases/Stream's ops on --stream-listen, framed (server/framed.py); TLS as on the
        main port (client certificates required)."""
        host, port = listen_host_port(self.settings.server.stream_listen)
        ctx = None
        if access.tls is not None:  # (rotated files load into it, as into the other listeners')
            ctx = server_ssl_context(access.tls, require_client_cert=True)
            self._framed_reloader = CertReloader(access.tls.watch(), [ctx], CERT_CHECK_S)
            self._framed_reloader.start()
        self._framed = FramedStreams(leases, access.policy, self.settings.server.max_message_bytes)
        try:
            self.stream_port = await self._framed.start(host, port, ctx)
        except OSError as e:
            raise OSError(
                f"cannot listen on --stream-listen {self.settings.server.stream_listen}: {e}"
            ) from e

    async def _own(self, cp: ControlPlane, peers: Peers, announced: str, tls: TlsFiles | None) -> None:
        """Own claim shards (controlplane.owners): under this replica's id and address, the
        others counted from the announcements, forwarding over the Owners RPC; the fair
        share taken now when etcd answers (else as operations need them)."""
        stream = ""
        if announced and self.stream_port:  # (routers send lookups there: Leases/Routes)
            stream = join_host_port(split_host_port(announced, "advertise")[0], self.stream_port)
        cp.owners.me = OwnerRecord(replica=peers.id, address=announced, stream_address=stream)
        cp.owners.live = peers.live
        self._forwarder = OwnerClient(tls)
        peers.on_rotated.append(self._forwarder.rotated)
        cp.owned.forwarder = self._forwarder
        forwarder = self._forwarder

        async def offer(engine_id: str, releases: list[Release]) -> bool:
            return await forwarder.offer_releases(peers.addresses, engine_id, releases)

        cp.budgets.relay.offer = offer  # (releases of nodes attached to another replica)
        # Promised notice of node demotions, both ways (controlplane.notices).
        cp.store.notices.transport = forwarder
        self._tasks.append(
            asyncio.create_task(hold_promises(cp.store.writer, forwarder, announced), name="promises")
        )
        cp.owners.start()
        with contextlib.suppress(StoreUnavailable):
            await cp.owners.balance()

    async def _open_store(self) -> EtcdStore:
        """The store, connected (etcd not answering yet is logged, not fatal: lookups answer
        store_unavailable until it does)."""
        s = self.settings
        endpoints = s.etcd.endpoints
        if not endpoints:
            self.embedded = EmbeddedEtcd(
                s.etcd.data_dir, s.etcd.embedded_client_port, s.etcd.embedded_peer_port
            )
            await self.embedded.start()
            endpoints = (self.embedded.endpoint,)
        store = EtcdStore(
            endpoints,
            Keys(s.etcd.prefix),
            s.etcd.timeout_s,
            s.gc.bucket_s,
            s.gc.max_keys_per_lease,
            s.gc.claim_marker_s,
            EtcdTls(s.etcd.ca, s.etcd.cert, s.etcd.key) if s.etcd.ca is not None else None,
        )
        self._store = store
        await store.connect()
        try:
            await store.ready(timeout_s=30.0 if self.embedded else 5.0)
        except StoreUnavailable:
            # Serve anyway: lookups answer store_unavailable until etcd is back.
            log.warning("etcd.unreachable_at_start", endpoints=list(endpoints))
        return store

    def _serve_metrics(self) -> None:
        """Prometheus metrics on their own port, on the gRPC listen host (-1: off)."""
        s = self.settings.server
        if s.metrics_port < 0:
            return
        host, _ = listen_host_port(s.listen)
        tls = self.settings.security.tls_files()
        files = {} if tls is None else _metrics_tls(tls)
        try:
            httpd, _ = start_http_server(s.metrics_port, addr=host, **files)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{s.metrics_port}: {e}") from e
        self._metrics_httpd, self.metrics_port = httpd, httpd.server_address[1]
        self._metrics_reloader = _guard_metrics(httpd, tls)

    def _start_loops(self, cp: ControlPlane, store: EtcdStore) -> None:
        """The background loops: etcd names followed, the node view refreshed, releases
        relayed, dead nodes collected, the gauges scanned, the loop's stalls timed."""
        s = self.settings
        self._tasks.append(asyncio.create_task(store.follow_dns(s.etcd.dns_refresh_s), name="etcd-dns"))
        self._tasks.append(asyncio.create_task(store.follow_certs(CERT_CHECK_S), name="etcd-certs"))
        self._tasks.append(asyncio.create_task(cp.nodes.run(), name="node-cache"))
        self._tasks.append(asyncio.create_task(cp.nodes.keep_confirmed(), name="node-confirm"))
        self._tasks.append(asyncio.create_task(stalls.watch_loop_lag(), name="loop-lag"))
        stalls.time_gc_pauses()
        self._tasks.append(asyncio.create_task(cp.budgets.relay.run(), name="release-relay"))
        if s.nodes.gc_after_s > 0:
            interval = min(60.0, s.nodes.gc_after_s / 4)
            self._tasks.append(asyncio.create_task(cp.registry.run_gc(interval), name="node-gc"))
        if s.gc.gauge_scan_s > 0:
            self._tasks.append(asyncio.create_task(cp.gauges.run(s.gc.gauge_scan_s), name="gauges"))

    async def stop(self) -> None:
        """Stop serving (in-flight RPCs get the grace period), then etcd. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.settings.server.grace_s
        if self._metrics_httpd is not None:
            # Its serve_forever notices a shutdown within 0.5 s: that wait runs beside the rest
            # of the stop, not before the process may exit (a restart is that much quicker).
            httpd = self._metrics_httpd
            threading.Thread(target=lambda: (httpd.shutdown(), httpd.server_close()), daemon=True).start()
        for reloader in (self._metrics_reloader, self._framed_reloader):
            if reloader is not None:
                await reloader.stop()
        if self.control_plane is not None:
            self.control_plane.begin_stop()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._framed is not None:
            await self._framed.stop()
        if self._server is not None:
            await self._server.stop(grace)
        if self.control_plane is not None:
            await self.control_plane.settle()  # (before the store closes under them)
            await self.control_plane.close()  # (every shard handed over, cleanly)
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self.peers is not None:
            await self.peers.close()
        if self._forwarder is not None:
            await self._forwarder.close()
        if self._store is not None:
            await self._store.close()
        if self.embedded is not None:
            await self.embedded.stop()
        log.info("daemon.stopped")

    async def __aenter__(self) -> Daemon:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _metrics_tls(tls: TlsFiles) -> dict[str, Any]:
    """start_http_server's arguments for HTTPS with client certificates of the CA (a
    Prometheus scraping with one; rotated files are loaded by a `CertReloader`)."""
    return {
        "certfile": str(tls.cert),
        "keyfile": str(tls.key),
        "client_cafile": str(tls.ca),
        "client_auth_required": True,
    }


def _guard_metrics(httpd: WSGIServer, tls: TlsFiles | None) -> CertReloader | None:
    """Each metrics client in its own thread, within a time: a slow or silent one holds
    that thread only, for METRICS_CLIENT_TIMEOUT_S at most (an idle connection stopped
    every scrape: the accepting thread waited on its TLS handshake). With TLS, rotated
    files are loaded: -> the started reloader."""
    handler = cast(type[BaseRequestHandler], httpd.RequestHandlerClass)
    httpd.RequestHandlerClass = type(handler.__name__, (handler,), {"timeout": METRICS_CLIENT_TIMEOUT_S})
    if tls is None:
        return None
    listening = cast(ssl.SSLSocket, httpd.socket)
    listening.do_handshake_on_connect = False  # type: ignore[attr-defined]  # (the client thread's)
    reloader = CertReloader(tls.watch(), [listening.context], CERT_CHECK_S)
    reloader.start()
    return reloader


def _warn_open(s: Settings, access: Access) -> None:
    """Say once what an open door the configuration leaves."""
    host, _ = listen_host_port(s.server.listen)
    if access.tls is None and not is_loopback(host):
        log.warning("daemon.insecure", listen=s.server.listen, why="--insecure: plaintext, anyone may call")
    if access.policy is None and (access.tls is not None or not is_loopback(host)):
        log.warning("daemon.no_policy", why="no --policy: every caller that gets in is an admin")


def _check_listen_free(listen: str) -> None:
    """Refuse at once when something already listens on the gRPC address (a daemon left
    running, say), rather than after starting and waiting for etcd."""
    host, port = listen_host_port(listen)
    if port and not port_free(host or "0.0.0.0", port):
        raise OSError(
            f"cannot listen on {listen}: the port is in use (another kvferry daemon?); "
            f"a second daemon on this machine needs {SECOND_DAEMON}"
        )


def advertised(listen: str, port: int, advertise: str) -> str:
    """The address other replicas reach this one at.

    `advertise` as given when it names a port; a bare host (a name, an IPv4 or an IPv6
    address: what a manifest's ``$(POD_IP)`` gives) gets the bound port, an IPv6 one in
    brackets. Without it, the listen host with the bound port; for a wildcard listen, this
    host's name resolved (what a container's /etc/hosts maps to its address), or "" when
    that is loopback. (A listen on loopback is announced as it is: replicas on one host
    reach each other there.)"""
    if advertise:
        host, named_port = split_host_port(advertise, "advertise")
        return join_host_port(host, named_port or port)
    host, _ = listen_host_port(listen)
    if host in ("0.0.0.0", "::"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            return ""
        if ipaddress.ip_address(host).is_loopback:
            return ""
    return join_host_port(host, port)


async def run(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT (or the embedded etcd dies), then shut down gracefully."""
    daemon = Daemon(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await daemon.start()
    except BaseException:
        await daemon.stop()  # what did start (the gRPC server, the embedded etcd) stops again
        raise
    waiters: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
    if daemon.embedded is not None:
        waiters.append(asyncio.create_task(daemon.embedded.wait_exited()))
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for p in pending:
        p.cancel()
    code = 0
    if not stop.is_set():
        assert daemon.embedded is not None
        log.error("etcd.embedded.exited", code=waiters[1].result(), etcd_log=str(daemon.embedded.log_path))
        code = 1
    log.info("daemon.stopping")
    await daemon.stop()
    return code

"""The node at the daemon: Nodes/Register, then one Nodes/Attach stream held open.

While the engine is vouched for (it answers, and its process identity is
confirmed: engine.py) the session keeps an Attach stream open, heartbeating
every third of the liveness TTL and sending the KV mirror's changes (at the
latest `flush_interval_s` after the first one, at once when `flush_hashes` are
pending). Each heartbeat carries the sidecar's count of uncaptured turns and the
blocks they pin (sidecar.unretained), which the daemon shows on the node. Every
new stream starts with a reset batch: the daemon's index of the node is rebuilt
from the mirror. A stream that ends suspends the node at the
daemon (identity.py), so the engine in doubt closes it at once.

Registration: before every stream, since the last one's end suspended the node.
The current epoch's known generation is registered again (the same engine
process still holding its blocks); a new epoch registers with generation 0 (the
daemon assigns the next one), as does a node whose known generation the daemon
refuses (a newer one is registered). A refused hello or heartbeat
(FAILED_PRECONDITION or NOT_FOUND) means the same: register again.

Failing over: the liveness lapses a TTL after the last heartbeat the daemon
could apply, so a replica that leaves a heartbeat unanswered (or answered
without refreshing the liveness: its etcd in trouble) for a quarter of the TTL,
or a call for as long, is given up for the next one: with heartbeats every
third of the TTL the node is registered elsewhere well within it. Traffic
through the tap is not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from urllib.parse import urlsplit

import aiohttp
import grpc
import structlog

from kvferry.structs import struct_to_dict
from kvferry.tasks import cancel_and_wait
from kvferry.urls import is_loopback, join_host_port
from kvferry.v1 import nodes_pb2
from sidecar.daemon import Backoff, DaemonLink
from sidecar.engine import EngineFacts, EngineInstance, learn_facts
from sidecar.kvindex import KvBatch, KvMirror
from sidecar.metrics import SidecarMetrics
from sidecar.releases import Releaser, ReleasesSeen
from sidecar.settings import Settings, listen_address
from sidecar.unretained import UnretainedLedger

log = structlog.get_logger(__name__)

_AttachCall = grpc.aio.StreamStreamCall[nodes_pb2.AttachRequest, nodes_pb2.AttachResponse]
_ROLES = {"prefill": nodes_pb2.PREFILL, "decode": nodes_pb2.DECODE, "both": nodes_pb2.BOTH}
_REFUSED = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})
_DENIED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class _LinkLost(Exception):
    """The Attach stream stopped answering heartbeats."""


def batch_message(b: KvBatch) -> nodes_pb2.AttachRequest:
    return nodes_pb2.AttachRequest(
        kv_events=nodes_pb2.KvEventBatch(
            seq=b.seq, stored=b.stored, removed=b.removed, cleared=b.cleared, reset=b.reset
        )
    )


def advertised_url(s: Settings, tap_port: int) -> str:
    """The tap's URL as the node registers it: --advertise-url, else the side-channel host
    (the pod's address, say; an IPv6 one in brackets) with the tap's port (https with TLS)."""
    if s.tap.advertise_url:
        return s.tap.advertise_url
    return f"{s.scheme}://{join_host_port(s.side_channel_host, tap_port or listen_address(s)[1])}"


def advertised_engine_url(s: Settings, http_url: str) -> str:
    """The node's engine_url given its http_url ("" = none: requests go through the tap).

    Only nodes that prefill have one (the router sends them tokenize and prefill
    requests; a decode node's requests all need the tap). By default the engine's own
    URL, unless that is a loopback address while the tap's is not: a router on another
    host could not reach it. (A router that cannot connect to it falls back to http_url.)
    """
    chosen = s.tap.advertise_engine_url
    if chosen == "none" or s.engine.role == "decode":
        return ""
    if chosen:
        return chosen.rstrip("/")
    if is_loopback(urlsplit(s.engine.url).hostname or "") and not is_loopback(
        urlsplit(http_url).hostname or ""
    ):
        return ""
    return s.engine.url.rstrip("/")


class NodeSession:
    """Keeps the node registered and attached while the engine is up."""

    def __init__(
        self,
        settings: Settings,
        instance: EngineInstance,
        mirror: KvMirror,
        link: DaemonLink,
        http: aiohttp.ClientSession,
        metrics: SidecarMetrics,
        unretained: UnretainedLedger | None = None,
        releaser: Releaser | None = None,
    ) -> None:
        self._s = settings
        self._releaser = releaser
        self._instance = instance
        self._mirror = mirror
        self._link = link
        self._http = http
        self._metrics = metrics
        self._unretained = unretained
        self._registered_epoch: int | None = None
        self._generation = 0
        self._ttl = float(settings.daemon.liveness_ttl_s)
        # A call, or a heartbeat, left unanswered this long gives the replica up.
        self._give_up_s = min(settings.daemon.rpc_timeout_s, self._ttl / 4)
        self._wakeup = asyncio.Event()
        self._released = ReleasesSeen()
        self._kv_since: float | None = None
        self.tap_port = 0
        """Port the tap listens on (for the default advertised URL); set by the app."""
        instance.watch(self._wakeup.set)

    # -- called by the KV ingest ---------------------------------------------------

    def kv_changed(self) -> None:
        """The mirror has changes to send."""
        if self._kv_since is None:
            self._kv_since = asyncio.get_running_loop().time()
            self._wakeup.set()
        elif self._mirror.pending >= self._s.kv_events.flush_hashes:
            self._wakeup.set()

    # -- the session loop -------------------------------------------------------------

    async def run(self) -> None:
        backoff = Backoff(self._s.daemon.backoff_initial_s, self._s.daemon.backoff_max_s)
        up = self._instance.up
        while True:
            if not up.is_set():
                await up.wait()
            channel = self._link.channel()
            try:
                epoch = self._instance.epoch
                await self._register(channel, epoch)
                if await self._attached(channel, epoch):
                    backoff.reset()
                continue
            except grpc.aio.AioRpcError as e:
                if e.code() in _REFUSED:
                    self._instance.unregistered()
                    self._metrics.attaches.labels("refused").inc()
                    log.info("node.refused", code=e.code().name, detail=e.details())
                    await asyncio.sleep(min(backoff.next(), 0.2))
                    continue
                if e.code() is grpc.StatusCode.INVALID_ARGUMENT:  # another replica would say the same
                    self._metrics.attaches.labels("invalid").inc()
                    log.error("node.register.invalid", address=self._link.address, detail=e.details())
                elif e.code() in _DENIED:  # (the policy, or this sidecar's certificate, is wrong)
                    self._metrics.attaches.labels("denied").inc()
                    log.error("node.register.denied", code=e.code().name, detail=e.details())
                else:
                    self._metrics.attaches.labels("failed").inc()
                    log.warning(
                        "node.daemon.unreachable",
                        address=self._link.address,
                        code=e.code().name,
                        detail=e.details(),
                    )
                    await self._link.failover(channel)
            except _LinkLost:
                self._metrics.attaches.labels("lost").inc()
                log.warning("node.attach.lost", address=self._link.address)
                await self._link.failover(channel)
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("node.engine.facts_failed", error=str(e))
            await asyncio.sleep(backoff.next())

    async def _facts(self) -> EngineFacts:
        facts = self._instance.facts
        if facts is None:
            epoch = self._instance.epoch
            facts = await learn_facts(self._http, self._s.engine)
            if facts.identity != self._instance.tracker.known:
                # Read from another process than the one vouched for: in doubt until probed.
                self._instance.suspend("facts")
                raise aiohttp.ClientPayloadError("the engine's process changed while its facts were read")
            if self._instance.epoch == epoch:  # not learned from a process that is gone
                self._instance.facts = facts
            log.info("engine.facts", model=facts.model, block_size=facts.block_size)
        return facts

    def _request(self, facts: EngineFacts, generation: int) -> nodes_pb2.RegisterNodeRequest:
        s = self._s
        host = s.side_channel_host
        url = advertised_url(s, self.tap_port)
        return nodes_pb2.RegisterNodeRequest(
            engine_id=s.node_id,
            role=_ROLES[s.engine.role],
            model=facts.model,
            block_size=facts.block_size,
            http_url=url,
            engine_url=advertised_engine_url(s, url),
            side_channel_host=host,
            side_channel_port=s.engine.side_channel_port,
            generation=generation,
            liveness_ttl_seconds=s.daemon.liveness_ttl_s,
            engine_started_at=facts.started_at,
            # (epoch 0: the engine as this sidecar first found it, no restart seen since)
            no_restart_seen=self._instance.epoch == 0,
        )

    async def _register(self, channel: grpc.aio.Channel, epoch: int) -> None:
        facts = await self._facts()
        stub = self._link.nodes(channel)
        timeout = self._give_up_s
        # The same engine process keeps its generation; a new one asks for the next.
        known = self._generation if self._registered_epoch == epoch else 0
        try:
            resp = await stub.Register(self._request(facts, known), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if not known or e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                self._metrics.node_registrations.labels("failed").inc()
                raise
            log.warning("node.register.superseded", generation=known, detail=e.details())
            resp = await stub.Register(self._request(facts, 0), timeout=timeout)
        self._registered_epoch = epoch
        self._generation = resp.node.generation
        self._metrics.node_registrations.labels("restarted" if resp.restarted else "ok").inc()
        log.info(
            "node.register.complete",
            engine_id=self._s.node_id,
            generation=self._generation,
            restarted=resp.restarted,
            epoch=epoch,
        )
        self._instance.set_generation(epoch, self._generation)

    async def _attached(self, channel: grpc.aio.Channel, epoch: int) -> bool:
        """Hold one Attach stream until the engine goes down or restarts. -> it was healthy."""
        generation = self._generation
        call = self._link.nodes(channel).Attach(None)
        reader: asyncio.Task[None] | None = None
        try:
            await call.write(
                nodes_pb2.AttachRequest(
                    hello=nodes_pb2.AttachHello(engine_id=self._s.node_id, generation=generation)
                )
            )
            async with asyncio.timeout(self._give_up_s):
                first = await call.read()
            if not isinstance(first, nodes_pb2.AttachResponse):
                raise _LinkLost()  # the daemon closed the stream
            ttl = first.ttl_seconds or self._ttl
            self._metrics.attaches.labels("ok").inc()
            self._metrics.attached.set(1)
            log.info("node.attach.open", engine_id=self._s.node_id, generation=generation, ttl_s=ttl)
            self._mirror.request_reset()
            self._kv_since = None
            self.kv_changed()
            loop = asyncio.get_running_loop()
            acked = [loop.time()]
            reader = asyncio.create_task(self._read_acks(call, acked), name="sidecar-attach-reader")
            await self._serve(call, reader, acked, epoch, ttl)
            return True
        except TimeoutError as e:
            raise _LinkLost() from e
        finally:
            self._metrics.attached.set(0)
            # The daemon forgets this node's blocks with the stream: the next attach sends
            # the whole mirror, and no delta needs keeping until then.
            self._mirror.request_reset()
            call.cancel()  # (before the await: a second cancellation there would skip it)
            await cancel_and_wait([reader])

    async def _read_acks(self, call: _AttachCall, acked: list[float]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                msg = await call.read()
                if not isinstance(msg, nodes_pb2.AttachResponse):
                    return  # end of stream
                if msg.HasField("release"):
                    self._release(msg.release)
                elif msg.HasField("heartbeat_ack") and msg.ttl_seconds > 0:  # (0: not refreshed)
                    acked[0] = loop.time()
                    self._metrics.heartbeats.labels("acked").inc()
        finally:
            self._wakeup.set()

    async def _serve(
        self,
        call: _AttachCall,
        reader: asyncio.Task[None],
        acked: list[float],
        epoch: int,
        ttl: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        kv = self._s.kv_events
        interval = max(min(ttl, self._ttl) / 3.0, 0.05)
        next_beat = loop.time()
        unacked_since = math.inf  # when the oldest heartbeat not answered yet went out
        seq = 0
        while self._instance.epoch == epoch and self._instance.up.is_set():
            self._wakeup.clear()  # before acting: a wake-up while writing below is not lost
            if reader.done():
                reader.result()  # raises the stream's error
                raise _LinkLost()  # the daemon ended the stream
            now = loop.time()
            if acked[0] >= unacked_since:
                unacked_since = math.inf
            if now - unacked_since > self._give_up_s:
                raise _LinkLost()
            if now >= next_beat:
                seq += 1
                await call.write(nodes_pb2.AttachRequest(heartbeat=self._heartbeat(seq)))
                self._metrics.heartbeats.labels("sent").inc()
                next_beat = now + interval
                unacked_since = min(unacked_since, now)
            since = self._kv_since
            if since is not None and (
                now >= since + kv.flush_interval_s or self._mirror.pending >= kv.flush_hashes
            ):
                await self._send_kv(call)
            since = self._kv_since
            wake_at = min(next_beat, unacked_since + self._give_up_s)
            if since is not None:
                wake_at = min(wake_at, since + kv.flush_interval_s)
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that lands as the event fires, and this loop would then never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wake_at - loop.time(), 0.0)):
                    await self._wakeup.wait()

    def _release(self, release: nodes_pb2.ReleaseRetention) -> None:
        """The daemon revoked a retention of this node (its budget, the conversation's end):
        have D free the blocks through a prefill node (the releaser of replaced retentions),
        once (the daemon tells a release at least once: `ReleasesSeen`)."""
        facts = self._instance.facts
        params = struct_to_dict(release.kv_transfer_params)
        first = self._released.first(release.conversation_id, params)
        log.info(
            "retention.released_early",
            conversation_id=release.conversation_id,
            reason=release.reason,
            sent=facts is not None and self._releaser is not None and first,
            again=not first,
        )
        if facts is None or self._releaser is None or not first:
            return  # (made already; or the engine's facts are gone with its process, and the blocks with it)
        self._metrics.releases.labels(release.reason or "daemon").inc()
        self._releaser.release(params, facts.model, facts.block_size, release.conversation_id)

    def _heartbeat(self, seq: int) -> nodes_pb2.Heartbeat:
        """A heartbeat, with what the daemon shows of the node's uncaptured turns and of its
        engine's KV pool."""
        beat = nodes_pb2.Heartbeat(seq=seq)
        pool = self._instance.pool
        if pool is not None:
            beat.pool_blocks, beat.pool_usage = pool.blocks, pool.usage
        if self._unretained is not None:
            beat.uncaptured_turns = self._unretained.turns
            beat.unretained_blocks = self._unretained.blocks(time.monotonic())
        return beat

    async def _send_kv(self, call: _AttachCall) -> None:
        self._kv_since = None
        for batch in self._mirror.drain():
            await call.write(batch_message(batch))
            self._metrics.kv_batches_sent.inc()
            self._metrics.kv_hashes_sent.inc(batch.size)
            if batch.reset:
                self._metrics.kv_resets.inc()
        self._metrics.kv_mirror_blocks.set(len(self._mirror))

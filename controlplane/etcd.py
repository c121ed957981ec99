"""etcd plumbing: the aetcd client on a multi-member channel, error translation at
the boundary, and group commit of independent transactions.

Library errors become the project's own `StoreUnavailable` here (`timed`);
everything above this module speaks kvferry, not gRPC status codes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import deque
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aetcd
import grpc
import structlog
from aetcd import rpc

from controlplane import metrics
from controlplane.errors import StoreUnavailable
from kvferry.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from kvferry.tasks import cancel_and_wait
from kvferry.urls import join_host_port, split_host_port

T = TypeVar("T")
log = structlog.get_logger(__name__)


class LeaseGone(Exception):
    """etcd does not know a lease a write named (expired, or the cluster was restored)."""


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Come back quickly after an etcd restart instead of gRPC's default minutes of backoff:
    # a connection attempt at least every 250 ms (cheap), so a daemon starting beside an
    # etcd that is still loading its data serves within 250 ms of etcd's readiness, not
    # up to a second after it (a restart of the embedded pair measured in bench.daemon).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]


@dataclass(frozen=True)
class EtcdTls:
    """TLS to an external etcd (etcd's --trusted-ca-file, and with --client-cert-auth the
    client certificate the daemon presents)."""

    ca: Path
    """CA that signed etcd's server certificate."""
    cert: Path | None = None
    """The daemon's client certificate (None: none presented)."""
    key: Path | None = None
    """Its private key."""

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials, read from the files now. Raises OSError naming the
        file that cannot be read."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca),
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )

    def stamp(self) -> tuple[float, ...]:
        """The files' modification times (a change: rotated certificates)."""
        out = []
        for path in (self.ca, self.cert, self.key):
            try:
                out.append(path.stat().st_mtime if path else 0.0)
            except OSError:
                out.append(-1.0)  # (missing while a rotation swaps it: a change all the same)
        return tuple(out)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"cannot read etcd TLS file {path}: {e.strerror}") from e


def tls_options(endpoints: tuple[str, ...]) -> list[tuple[str, str]]:
    """Channel options for TLS to `endpoints`: with several, the channel's target is a list
    of addresses (see `channel_target`), so the server certificate is checked against the
    first endpoint's host (a cluster's shared certificate names every member)."""
    if len(endpoints) < 2:
        return []
    return [("grpc.ssl_target_name_override", _members(endpoints)[0][0])]


def channel_target(endpoints: tuple[str, ...], known: dict[str, list[str]] | None = None) -> str:
    """A gRPC target naming every endpoint, so the channel fails over between members.

    One endpoint: gRPC resolves a name itself, and again when it reconnects. Several: no
    gRPC target re-resolves a list of names, so they are resolved here, to a fixed list
    of addresses (every address of each name, in a stable order; `Client.follow_dns`
    resolves them again while the daemon runs: a member's pod restarted under a new
    address). `known` (updated here) holds each name's last addresses: a name that does
    not resolve keeps them (a DNS outage must not cut the daemon off a working etcd), and
    one never resolved is left out while another name resolves (a member not up yet);
    when none has any address, the first name is the target, for gRPC to resolve.
    """
    members = _members(endpoints)
    if len(members) == 1:
        host, port = members[0]
        return join_host_port(host, port) if _is_ip(host) else f"dns:///{join_host_port(host, port)}"
    known = {} if known is None else known
    addrs: list[tuple[str, int]] = []  # (IP, port)
    for ep, (host, port) in zip(endpoints, members, strict=True):
        try:
            known[ep] = [host] if _is_ip(host) else _resolve(host)
        except OSError as e:
            log.warning("etcd.endpoint.unresolved", endpoint=ep, error=str(e), kept=known.get(ep, []))
        addrs += [(ip, port) for ip in known.get(ep, [])]
    if not addrs:
        return f"dns:///{join_host_port(*members[0])}"
    if all(":" not in ip for ip, _ in addrs):
        return "ipv4:" + ",".join(join_host_port(ip, port) for ip, port in addrs)
    # One scheme per target: IPv4 members as IPv4-mapped IPv6 addresses beside IPv6 ones.
    return "ipv6:" + ",".join(join_host_port(ip if ":" in ip else "::ffff:" + ip, port) for ip, port in addrs)


def _members(endpoints: tuple[str, ...]) -> list[tuple[str, int]]:
    """(host, port) of each endpoint (a bare IPv6 host: no brackets)."""
    out = []
    for ep in endpoints:
        host, port = split_host_port(ep, "etcd endpoint")
        if port is None:
            raise ValueError(f"etcd endpoint {ep!r} must be host:port")
        out.append((host, port))
    return out


def _resolve(host: str) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6), sorted: the same list for the same
    records, whatever order the resolver gives them in."""
    return sorted({str(ai[4][0]) for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client on a channel that knows all cluster members."""

    def __init__(self, endpoints: tuple[str, ...], timeout: float, tls: EtcdTls | None = None) -> None:
        super().__init__(timeout=timeout)
        self._endpoints = endpoints
        self._tls = tls
        self._known: dict[str, list[str]] = {}  # each endpoint's last addresses
        # Names `channel_target` resolved that the channel will not resolve again (several).
        self._names = len(endpoints) > 1 and not all(_is_ip(h) for h, _ in _members(endpoints))
        self.target = ""
        self._retired: set[asyncio.Task[None]] = set()

    async def connect(self) -> None:
        """Open the channel (resolving the endpoints' names first; see `channel_target`)."""
        if self._connected.is_set():
            return
        self._open(await asyncio.to_thread(channel_target, self._endpoints, self._known))
        self._connected.set()

    def _open(self, target: str) -> None:
        """Calls from now on go to a channel on `target` (each call takes the stubs anew)."""
        self.target = target
        if self._tls is None:
            self.channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            options = _CHANNEL_OPTIONS + tls_options(self._endpoints)
            self.channel = grpc.aio.secure_channel(target, self._tls.credentials(), options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)

    async def follow_dns(self, interval_s: float) -> None:
        """Resolve the endpoints' names every `interval_s`, and move to a new channel when
        an address changed (see `channel_target`); calls already on the old one finish.
        Returns at once when there are none to follow."""
        while self._names:
            await asyncio.sleep(interval_s)
            target = await asyncio.to_thread(channel_target, self._endpoints, self._known)
            if target == self.target:
                continue
            log.info("etcd.endpoints.moved", before=self.target, after=target)
            self._reopen(target)

    def _reopen(self, target: str) -> None:
        """Move to a new channel on `target`; calls already on the old one finish."""
        old = self.channel
        self._open(target)
        task = asyncio.create_task(old.close(grace=self._timeout), name="etcd-old-channel")
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def follow_certs(self, interval_s: float) -> None:
        """Check the TLS files every `interval_s`; when they change (a rotation), move to a
        new channel presenting the new certificate. Returns at once without TLS."""
        if self._tls is None:
            return
        stamp = self._tls.stamp()
        while True:
            await asyncio.sleep(interval_s)
            now = self._tls.stamp()
            if now == stamp:
                continue
            try:
                self._reopen(self.target)
            except (OSError, ValueError, RuntimeError) as e:  # half-written: the next check retries
                log.warning("etcd.tls.reload_failed", error=str(e))
                continue
            stamp = now
            log.info("etcd.tls.reloaded", ca=str(self._tls.ca), cert=str(self._tls.cert))

    async def close(self) -> None:
        """Close the channel, and those that name changes retired."""
        if self.channel is not None:
            await self.channel.close(None)
        await asyncio.gather(*self._retired, return_exceptions=True)


async def timed(op: str, call: Awaitable[T]) -> T:
    """Await one etcd call, recording its latency and translating its errors."""
    start = time.perf_counter()
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (e.details() or ""):
            raise LeaseGone(e.details() or "") from e
        metrics.ETCD_ERRORS.labels(op, code.name).inc()
        raise StoreUnavailable(f"etcd {op}: {code.name}: {e.details()}") from e
    except aetcd.ClientError as e:
        metrics.ETCD_ERRORS.labels(op, type(e).__name__).inc()
        raise StoreUnavailable(f"etcd {op}: {e}") from e
    except (TimeoutError, ConnectionError, OSError) as e:
        metrics.ETCD_ERRORS.labels(op, type(e).__name__).inc()
        raise StoreUnavailable(f"etcd {op}: {e!r}") from e
    finally:
        metrics.ETCD_LATENCY.labels(op).observe(time.perf_counter() - start)


# One submitted transaction waiting to leave: (op name, txn, the keys it writes, its caller's answer).
_Queued = tuple[str, rpc.TxnRequest, tuple[bytes, ...], asyncio.Future[rpc.TxnResponse]]


class TxnBatcher:
    """Group commit: transactions submitted concurrently leave as one etcd Txn.

    Each submitted transaction becomes a nested transaction (etcd >= 3.3) of one
    outer Txn, so each keeps its own compares and atomicity, while etcd and this
    process pay for one request. Nothing waits for a batch to fill: a batch
    leaves as soon as fewer than `max_inflight` are in flight, so a lone request
    goes out at once and batches only grow under load. Two transactions touching
    the same key never share a batch (etcd refuses duplicate keys in one Txn);
    the later one goes in a later batch.

    One batch in flight by default: what arrives meanwhile waits for it and leaves
    together. Measured at 1,000 lookups/s (`bench.lookup_tail`, 4 A/B pairs): p99
    7.1-9.1 ms with one in flight, 9.2-13.7 with four, because the fewer etcd
    requests (0.05 instead of 0.16 per turn) leave the 2 cores more room; a lone
    request still goes out at once. Once a full batch waits (an etcd slower than the
    arrivals: a remote cluster, a burst), up to `max_burst` batches go in parallel, so
    throughput is not capped at one batch per round trip.
    """

    def __init__(
        self,
        client: Client,
        timeout_s: float,
        max_items: int = 64,
        max_bytes: int = 1 << 20,
        max_inflight: int = 1,
        max_burst: int = 4,
    ) -> None:
        self._client = client
        self._timeout = timeout_s
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._max_inflight = max_inflight
        self._max_burst = max(max_burst, max_inflight)
        self._queue: deque[_Queued] = deque()
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def submit(self, op: str, txn: rpc.TxnRequest, keys: tuple[bytes, ...]) -> rpc.TxnResponse:
        """Run `txn` (whose writes touch `keys`) in the next batch. -> its own TxnResponse."""
        if self._closed:
            raise _closed_error()
        if not self._queue and self._inflight < self._max_inflight:
            # Idle: send it from the caller's own task (no hand-off, no extra wake-up).
            self._inflight += 1
            metrics.ETCD_BATCH_ITEMS.observe(1)
            try:
                resp: rpc.TxnResponse = await timed(op, self._client.kvstub.Txn(txn, timeout=self._timeout))
                return resp
            finally:
                self._inflight -= 1
                self._kick()
        fut: asyncio.Future[rpc.TxnResponse] = asyncio.get_running_loop().create_future()
        self._queue.append((op, txn, keys, fut))
        self._kick()
        return await fut

    def _kick(self) -> None:
        while self._queue and (
            self._inflight < self._max_inflight
            or (self._inflight < self._max_burst and len(self._queue) >= self._max_items)
        ):
            batch = self._take()
            self._inflight += 1
            task = asyncio.create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Queued]:
        batch: list[_Queued] = []
        taken: set[bytes] = set()
        size = 0
        deferred = []
        while self._queue and len(batch) < self._max_items:
            item = self._queue.popleft()
            if item[3].done():  # caller gave up before it left
                continue
            item_size = item[1].ByteSize()
            if taken.intersection(item[2]) or (batch and size + item_size > self._max_bytes):
                deferred.append(item)
                continue
            batch.append(item)
            taken.update(item[2])
            size += item_size
        self._queue.extendleft(reversed(deferred))
        return batch

    async def _send(self, batch: list[_Queued]) -> None:
        try:
            if not batch:
                return
            metrics.ETCD_BATCH_ITEMS.observe(len(batch))
            try:
                _answer(batch, await self._commit(batch))
            except LeaseGone:
                groups = _by_lease(batch)
                if len(groups) == 1:
                    raise
                # One lease etcd no longer has refused the whole batch (nothing applied): each
                # lease's items go again apart, so only those naming that lease fail (their
                # callers take a new one), not their batch-mates, whose one retry could meet
                # another stale lease and fail as "unavailable".
                outcomes = await asyncio.gather(*map(self._commit, groups), return_exceptions=True)
                for group, outcome in zip(groups, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        _fail(group, outcome)
                    else:
                        _answer(group, outcome)
        except Exception as e:  # StoreUnavailable, LeaseGone: every caller of the batch sees it
            _fail(batch, e)
        except asyncio.CancelledError:  # closed: nobody waits for an answer that will not come
            _fail(batch, _closed_error())
            raise
        finally:
            self._inflight -= 1
            self._kick()

    async def _commit(self, items: list[_Queued]) -> list[rpc.TxnResponse]:
        """Send `items` as one Txn (nested when several). -> each one's TxnResponse."""
        if len(items) == 1:
            op, txn, _, _ = items[0]
            return [await timed(op, self._client.kvstub.Txn(txn, timeout=self._timeout))]
        outer = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=item[1]) for item in items])
        resp = await timed("txn_batch", self._client.kvstub.Txn(outer, timeout=self._timeout))
        results = [r.response_txn for r in resp.responses]
        for result in results:  # etcd sets the header (the revision) on the outer one only
            result.header.CopyFrom(resp.header)
        return results

    async def close(self) -> None:
        """Send nothing more; every caller still waiting (queued, or in a batch in
        flight) gets StoreUnavailable."""
        self._closed = True
        _fail(self._queue, _closed_error())
        self._queue.clear()
        await cancel_and_wait(list(self._tasks))


def _closed_error() -> StoreUnavailable:
    return StoreUnavailable("etcd client closed")


def _answer(items: Iterable[_Queued], results: Iterable[rpc.TxnResponse]) -> None:
    for (*_, fut), result in zip(items, results, strict=True):
        if not fut.done():
            fut.set_result(result)


def _by_lease(items: list[_Queued]) -> list[list[_Queued]]:
    """`items` grouped by the leases their puts name (in order of first appearance)."""
    groups: dict[frozenset[int], list[_Queued]] = {}
    for item in items:
        ops = [*item[1].success, *item[1].failure]
        leases = frozenset(op.request_put.lease for op in ops if op.HasField("request_put"))
        groups.setdefault(leases, []).append(item)
    return list(groups.values())


def _fail(items: Iterable[_Queued], error: BaseException) -> None:
    """Answer the callers of `items` still waiting with `error`."""
    for *_, fut in items:
        if not fut.done():
            fut.set_exception(error)

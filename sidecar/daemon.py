"""The sidecar's connection to the daemon: one gRPC channel, failover between replicas, backoff.

With TLS the channel presents the sidecar's certificate (its identity at the daemon);
when the files change (a rotation), the next `channel()` makes a new channel with the new
certificate. Calls open on the old one go on; it is closed at the next failover or at
`close`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import grpc
import structlog

from kvferry.channels import daemon_channel, daemon_channel_options
from kvferry.framedstream import opener
from kvferry.leaseclient import Opener
from kvferry.security.tls import TlsFiles
from kvferry.v1 import leases_pb2_grpc, nodes_pb2_grpc

log = structlog.get_logger(__name__)

_CHANNEL_OPTIONS = daemon_channel_options(max_backoff_ms=2000)

#: Codes after which a call is worth repeating on the same or another replica.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


class Backoff:
    """Exponential backoff with jitter: initial, x2 per failure, capped."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial = initial_s
        self._max = max_s
        self._next = initial_s

    def next(self) -> float:
        """The delay before the next attempt."""
        delay = self._next
        self._next = min(self._next * 2, self._max)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self._initial


class DaemonLink:
    """The channel to the current daemon replica; `failover` moves to the next one."""

    def __init__(
        self, addresses: Sequence[str], tls: TlsFiles | None = None, stream_addresses: Sequence[str] = ()
    ) -> None:
        self._addresses = list(addresses)
        self._streams = list(stream_addresses)
        """The replicas' --stream-listen addresses, as `addresses` (none: Leases/Stream over gRPC)."""
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        # (a TlsFiles of its own: `changed()` answers each asker once)
        self._tls = None if tls is None else TlsFiles(tls.ca, tls.cert, tls.key)
        if self._tls is not None:
            self._tls.changed()
        self._retired: list[grpc.aio.Channel] = []

    @property
    def address(self) -> str:
        return self._addresses[self._index]

    def channel(self) -> grpc.aio.Channel:
        """The channel to the current replica (a new one after the TLS files changed)."""
        if self._channel is not None and self._tls is not None and self._tls.changed():
            log.info("daemon.channel.rotated", address=self.address, cert=str(self._tls.cert))
            self._retired.append(self._channel)
            self._channel = None
        if self._channel is None:
            try:
                self._channel = daemon_channel(self.address, self._tls, _CHANNEL_OPTIONS)
            except ValueError as e:  # (files being rewritten: the old certificate until they load)
                if not self._retired:
                    raise
                log.warning("daemon.channel.tls_unreadable", error=str(e))
                assert self._tls is not None
                self._tls.forget()
                self._channel = self._retired.pop()
        return self._channel

    def stream_opener(self) -> Opener | None:
        """What opens a framed Leases/Stream to the current replica (None: use its channel)."""
        return opener(self._streams[self._index], self._tls) if self._streams else None

    def nodes(self, channel: grpc.aio.Channel) -> nodes_pb2_grpc.NodesAsyncStub:
        return nodes_pb2_grpc.NodesStub(channel)

    def leases(self, channel: grpc.aio.Channel) -> leases_pb2_grpc.LeasesAsyncStub:
        return leases_pb2_grpc.LeasesStub(channel)

    async def failover(self, failed: grpc.aio.Channel) -> None:
        """`failed` did not work: use the next replica (no-op with one, or if already moved).

        The failed channel is closed; calls still open on it end and are retried
        on the new one by their owners.
        """
        await self._close_retired()
        if len(self._addresses) < 2 or failed is not self._channel:
            return
        self._channel = None
        self._index = (self._index + 1) % len(self._addresses)
        log.info("daemon.failover", address=self.address)
        await failed.close(None)

    async def _close_retired(self) -> None:
        retired, self._retired = self._retired, []
        for channel in retired:
            await channel.close(None)

    async def close(self) -> None:
        await self._close_retired()
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

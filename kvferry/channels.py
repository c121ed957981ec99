"""The routers', sidecars' and CLI's gRPC channels to the daemon: options and TLS.

Keepalive pings on them find a daemon replica that vanished without closing its
connections (a host gone, a network partition) within seconds: with nothing to
read, a stream of lookups or an Attach stream would otherwise wait on it until TCP
gives up, minutes later, instead of failing over. The daemon allows pings this
often (`controlplane.server.start_server`), and pings its clients in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvferry.security.tls import TlsFiles, grpc_channel_credentials

KEEPALIVE_TIME_MS = 10_000
"""A ping after this long without one (on every open connection, calls or not)."""
KEEPALIVE_TIMEOUT_MS = 5_000
"""A ping unanswered this long ends the connection (and its calls: UNAVAILABLE)."""
MESSAGE_LIMIT = 16 * 1024 * 1024


def daemon_channel_options(max_backoff_ms: int) -> list[tuple[str, int]]:
    """Options of a channel to a daemon replica: quick reconnects (at most `max_backoff_ms`
    apart), keepalive pings, and messages up to MESSAGE_LIMIT."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", max_backoff_ms),
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def daemon_channel(
    address: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to a daemon: TLS with this process's certificate as its identity
    when `tls` is given, plaintext otherwise (development mode, loopback)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, grpc_channel_credentials(tls), options=options)

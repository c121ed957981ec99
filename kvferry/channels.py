"""gRPC channel options of the routers' and sidecars' channels to the daemon.

Keepalive pings on them find a daemon replica that vanished without closing its
connections (a host gone, a network partition) within seconds: with nothing to
read, a stream of lookups or an Attach stream would otherwise wait on it until TCP
gives up, minutes later, instead of failing over. The daemon allows pings this
often (`controlplane.server.start_server`), and pings its clients in turn.
"""

from __future__ import annotations

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

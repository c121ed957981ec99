"""HTTP conventions between kvferry's own processes (the router and the sidecars)."""

from __future__ import annotations

import aiohttp

KEEPALIVE_S = 4.0
"""How long an idle connection to an engine (or a sidecar) is kept for reuse: less than
vLLM's 5 s (uvicorn's --timeout-keep-alive). A request sent on a connection the server is
closing at that moment fails after it left, so it cannot be retried as undelivered."""

NO_RETENTION_HEADER = "X-Kvferry-No-Retention"
"""Set by the router on a decode request nothing should be retained of (several answers,
non-text content): D's sidecar captures nothing, even when the body names a session."""

TURN_ID_HEADER = "X-Kvferry-Turn-Id"
"""Set by the router on every engine request: its own id of the turn, unique. D's sidecar
registers it with the retention, so that the turn's own lookup, should it reach the daemon
only after that, leaves it alone. (X-Request-Id carries the client's id when it sent one:
vLLM names its answer after it.)"""

NOT_DELIVERED_HEADER = "X-Kvferry-Not-Delivered"
"""Set on a sidecar's 502 when its engine was never reached: the request was not seen, so
the router may send it to another node as if the sidecar itself had been unreachable."""


def never_delivered(e: BaseException) -> bool:
    """An aiohttp request failed before the server could see it: no connection was made
    (refused, or a connect timeout: a TimeoutError too, but not one after sending)."""
    return isinstance(
        e, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | ConnectionRefusedError
    )

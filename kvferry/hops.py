"""HTTP client conventions on the hops between kvferry's own processes (the router and the
sidecars). The headers they exchange are `kvferry.turnheaders`'."""

from __future__ import annotations

import aiohttp

KEEPALIVE_S = 4.0
"""How long an idle connection to an engine (or a sidecar) is kept for reuse: less than
vLLM's 5 s (uvicorn's --timeout-keep-alive). A request sent on a connection the server is
closing at that moment fails after it left, so it cannot be retried as undelivered."""


def never_delivered(e: BaseException) -> bool:
    """An aiohttp request failed before the server could see it: no connection was made
    (refused, or a connect timeout: a TimeoutError too, but not one after sending)."""
    return isinstance(
        e, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | ConnectionRefusedError
    )

"""An HTTP server of kvferry's (the router's front door, the sidecar's tap): its listening
socket, and the deadlines of its connections.

aiohttp times out a connection that waits for its next request (its keep-alive timeout,
here the idle timeout), but a client that sends a request's head a byte at a time, or
opens a connection and sends nothing, keeps it as long as it likes under that alone. So
each connection's protocol is wrapped in a `HeadGuard`: a request's head must be
complete within the head timeout of its first byte (of the connection's opening, for
its first request), else the client gets a 408 and the connection is closed. The
server's middleware tells the guard when a head is in and when its handler is done
(`guard_middleware`, outermost in the router and in the sidecar's tap). The body's own
deadline is the handler's (`sidecar.bodies`, `router.http_api`); the idle one is
aiohttp's keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

log = structlog.get_logger(__name__)

#: After an answer sent before its request's body was all read (a refusal), how long the
#: rest is read and dropped, so that the client, still sending, sees the answer rather
#: than a reset; then the connection is closed. Nothing read then is kept.
LINGER_S = 2.0


def _raw_408(message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "RequestTimeout", "param": None, "code": 408}}
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class HeadGuard(asyncio.Protocol):
    """One connection's aiohttp protocol, with a deadline on each request's head."""

    def __init__(self, inner: RequestHandler, head_timeout_s: float) -> None:
        self.inner = inner
        self._head_timeout_s = head_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._busy = False
        self._partial = False
        """Bytes of a head have arrived since the last request began."""

    # -- asyncio.Protocol, passed on -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self._partial = True
            if self._timer is None:
                self._arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        self.inner.eof_received()
        return None  # (aiohttp's: the transport closes itself)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- told by the server's middleware ---------------------------------------------

    def head_received(self) -> None:
        """A request's head is complete and its handler runs."""
        self._busy = True
        self._partial = False
        self._disarm()

    def request_done(self) -> None:
        """The handler ended: the next bytes begin another head."""
        self._busy = False

    # -- the deadline ----------------------------------------------------------------

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._head_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        transport = self._transport
        if self._busy or transport is None or transport.is_closing():
            return
        if self._partial:
            log.info(
                "tap.head.timeout", timeout_s=self._head_timeout_s, peer=transport.get_extra_info("peername")
            )
            transport.write(_raw_408(f"request head not received within {self._head_timeout_s:g} s"))
        self.inner.force_close()


def guard_of(request: web.BaseRequest) -> HeadGuard | None:
    """The guard of the connection `request` came on (None: served otherwise, e.g. in a test client)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, HeadGuard) else None


@web.middleware
async def guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the connection's guard that a request's head is in, and when its handler ended."""
    guard = guard_of(request)
    if guard is not None:
        guard.head_received()
    try:
        return await handler(request)
    finally:
        if guard is not None:
            guard.request_done()


@dataclass(frozen=True)
class Deadlines:
    """How long a connection may take to send a request's head, and stay idle between requests."""

    head_timeout_s: float
    idle_timeout_s: float


class GuardedServer:
    """A listening server whose connections have `deadlines`: `start` then `close`.
    `runner` are more of aiohttp's AppRunner arguments (its shutdown grace, say)."""

    def __init__(self, app: web.Application, deadlines: Deadlines, **runner: Any) -> None:
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=deadlines.idle_timeout_s,
            **runner,
        )
        self._deadlines = deadlines
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on host:port (0: a free port, then in `port`)."""
        await self._runner.setup()
        factory = self._runner.server
        assert factory is not None
        head_timeout_s = self._deadlines.head_timeout_s
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: HeadGuard(factory(), head_timeout_s),
                host or None,
                port,
                ssl=ssl_context,
                # (a TLS handshake is part of the first head's time)
                ssl_handshake_timeout=head_timeout_s if ssl_context is not None else None,
            )
        except BaseException:
            await self._runner.cleanup()
            raise
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, let answers in flight end (the runner's grace), close every connection."""
        if self._server is not None:
            self._server.close()
        await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

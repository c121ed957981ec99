"""Leases/Stream without gRPC: the wire both ends speak (leases.proto, StreamHello) and
the client's side of it.

gRPC Python costs far more per message than a lookup costs the daemon: each message
crosses gRPC's C core, its poller thread and a wake-up of the asyncio loop, on both
sides. Measured on this project's 2-core VM, a stream server that does no work answered
1,000 lookups a second with a p99 of 13-15 ms over gRPC and 3.7 ms over this framing,
at less than half the CPU per op on each side (bench.echo's figures, same client logic).
So the daemon also serves Leases/Stream's ops on a plain (TLS) connection, framed:

- a frame is a 4-byte big-endian length and that many bytes of one protobuf message;
- the client sends a StreamHello, then LeaseOpBatch frames, and an empty frame when it
  is done writing (TLS has no half-close);
- the daemon sends an empty LeaseOpResultBatch once the caller is admitted, then
  LeaseOpResultBatch frames; a stream that ends in error gets a last batch whose only
  result has id 0 (`END_ID`) and carries the status; then the daemon closes.

`FramedCall` is a client stream with the methods of the gRPC stream call that
`kvferry.leaseclient.LeaseStream` uses (write, read, done_writing, cancel), failing as it
does (grpc.aio.AioRpcError), so that LeaseStream runs on either unchanged.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvferry.security.tls import TlsFiles, client_ssl_context
from kvferry.urls import split_host_port
from kvferry.v1 import leases_pb2

HEADER = struct.Struct(">I")
END_ID = 0
"""The id of the result that carries a stream's end status (ops are numbered from 1)."""
DEFAULT_MAX_FRAME = 4 * 1024 * 1024
"""The daemon's default max message size (a larger frame ends the stream)."""
WELCOME = HEADER.pack(0)
"""The daemon's first frame: an empty LeaseOpResultBatch (admitted)."""
DONE_WRITING = HEADER.pack(0)
"""The client's last frame: an empty one."""

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status an OpError's code number names (UNKNOWN: none)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


class FrameError(Exception):
    """A frame that breaks the framing: longer than the limit, or cut short."""


def frame(payload: bytes) -> bytes:
    """`payload` as one frame."""
    return HEADER.pack(len(payload)) + payload


def end_frame(code: grpc.StatusCode, message: str) -> bytes:
    """The frame that ends a stream with status `code`."""
    batch = leases_pb2.LeaseOpResultBatch()
    res = batch.results.add(id=END_ID)
    res.error.code, res.error.message = code.value[0], message
    return frame(batch.SerializeToString())


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next frame's payload (None: the connection ended cleanly, between frames);
    FrameError when it ends inside one or announces more than `max_bytes`."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("the connection ended inside a frame header") from None
    (n,) = HEADER.unpack(head)
    if n > max_bytes:
        raise FrameError(f"a frame of {n} bytes is over the limit of {max_bytes}")
    try:
        return await reader.readexactly(n) if n else b""
    except asyncio.IncompleteReadError:
        raise FrameError(f"the connection ended {n} bytes into a frame") from None


def end_status(batch: leases_pb2.LeaseOpResultBatch) -> tuple[grpc.StatusCode, str] | None:
    """The end status a batch carries (`end_frame`), if it is one."""
    if len(batch.results) == 1 and batch.results[0].id == END_ID:
        err = batch.results[0].error
        return status_code(err.code), err.message
    return None


def _retrieved(connected: asyncio.Future[Any]) -> None:
    """A failed connect's error is every call's to see; none may be left unretrieved."""
    if not connected.cancelled():
        connected.exception()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


class FramedCall:
    """One framed Leases/Stream to the daemon at host:port: connects when made (no await:
    the first write or read waits for it), as a gRPC stream call would."""

    def __init__(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        authorization: str = "",
        max_bytes: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self._max_bytes = max_bytes
        self._writer: asyncio.StreamWriter | None = None
        self._ended: grpc.aio.AioRpcError | None = None
        self._connected = asyncio.ensure_future(self._connect(host, port, ssl_context, authorization))
        self._connected.add_done_callback(_retrieved)

    async def _connect(
        self, host: str, port: int, ctx: ssl.SSLContext | None, authorization: str
    ) -> asyncio.StreamReader:
        try:
            reader, self._writer = await asyncio.open_connection(host, port, ssl=ctx, limit=2**20)
            hello = leases_pb2.StreamHello(authorization=authorization).SerializeToString()
            self._writer.write(frame(hello))
            welcome = await read_frame(reader, self._max_bytes)
        except (OSError, FrameError, ssl.SSLError) as e:
            raise self._end(grpc.StatusCode.UNAVAILABLE, f"framed stream to {host}:{port}: {e}") from None
        if welcome is None:
            raise self._end(grpc.StatusCode.UNAVAILABLE, f"{host}:{port} closed the stream at its start")
        self._check(leases_pb2.LeaseOpResultBatch.FromString(welcome))
        return reader

    def _end(self, code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        """The stream ended with `code`: every later call fails with it."""
        if self._ended is None:
            self._ended = _rpc_error(code, details)
            if self._writer is not None:
                self._writer.transport.abort()
        return self._ended

    def _check(self, batch: leases_pb2.LeaseOpResultBatch) -> None:
        status = end_status(batch)
        if status is not None:
            raise self._end(*status)

    async def write(self, batch: leases_pb2.LeaseOpBatch) -> None:
        """Send one batch of ops (AioRpcError when the stream is gone)."""
        await self._send(frame(batch.SerializeToString()))

    async def done_writing(self) -> None:
        """No more ops: the daemon answers those in flight, then ends the stream."""
        await self._send(DONE_WRITING)

    async def _send(self, data: bytes) -> None:
        await self._connected
        if self._ended is not None:
            raise self._ended
        assert self._writer is not None
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (OSError, RuntimeError) as e:  # (RuntimeError: the transport closed meanwhile)
            raise self._end(grpc.StatusCode.UNAVAILABLE, f"framed stream broke: {e}") from None

    async def read(self) -> Any:
        """The next batch of results; grpc.aio.EOF once the daemon ended the stream cleanly
        (AioRpcError when it ended it with a status, or the connection broke)."""
        reader = await self._connected
        if self._ended is not None:
            raise self._ended
        try:
            payload = await read_frame(reader, self._max_bytes)
        except (OSError, FrameError) as e:
            raise self._end(grpc.StatusCode.UNAVAILABLE, f"framed stream broke: {e}") from None
        if payload is None:
            self._end(grpc.StatusCode.OK, "ended")
            return grpc.aio.EOF  # type: ignore[attr-defined]  # missing from the stubs
        try:
            batch = leases_pb2.LeaseOpResultBatch.FromString(payload)
        except DecodeError:
            raise self._end(grpc.StatusCode.INTERNAL, "the daemon sent a batch that does not parse") from None
        self._check(batch)
        return batch

    def cancel(self) -> bool:
        """Drop the connection (the daemon cancels the ops in flight, as for a gRPC cancel)."""
        self._connected.cancel()
        self._end(grpc.StatusCode.CANCELLED, "framed stream cancelled")
        return True


def check_stream_addresses(addresses: Sequence[str], stream_addresses: Sequence[str]) -> None:
    """ValueError unless `stream_addresses` (a client's --daemon-stream) are none, or one
    host:port per daemon replica of `addresses` (its --daemon), in the same order."""
    if any(":" not in a for a in stream_addresses):
        raise ValueError("daemon stream addresses must be host:port")
    if stream_addresses and len(stream_addresses) != len(addresses):
        raise ValueError(
            f"--daemon-stream names {len(stream_addresses)} address(es) for {len(addresses)} "
            "daemon replica(s): give one per --daemon address, in the same order"
        )


def opener(address: str, tls: TlsFiles | None = None, authorization: str = "") -> Callable[[], FramedCall]:
    """What opens a framed stream to the daemon's --stream-listen `address` (host:port) for a
    `kvferry.leaseclient.LeaseStream`: TLS with `tls`'s certificate as the caller's identity
    (read again at each opening: a rotated certificate goes on the next stream)."""
    host, port = split_host_port(address, "framed stream address")
    if port is None:
        raise ValueError(f"framed stream address {address!r}: expected HOST:PORT")

    def open_call() -> FramedCall:
        return FramedCall(host, port, None if tls is None else client_ssl_context(tls), authorization)

    return open_call

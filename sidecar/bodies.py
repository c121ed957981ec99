"""Reading a request body with bounded memory: a cap on the bytes sent, a cap on what
they decompress to, a budget of body bytes held across all requests, and a deadline.

What went wrong before: aiohttp's ``request.read()`` raised its read chunk to the body
limit (64 MiB), so each connection's stream buffered up to twice that before pausing
the socket, and the server decompressed gzip/deflate on its own with that chunk as the
output step: 8 refused 70 MB bodies kept +595 MB, 24 gzip bombs of 4.5 MB 10.4 GB.
Here aiohttp's decompression is off (the tap's server is made with
``auto_decompress=False``), the stream keeps aiohttp's small default buffer (the
socket is paused past 128 KiB), and this module reads chunk by chunk:

- a declared Content-Length over the cap is refused before a byte is read (413);
- the bytes read, and the bytes they decompress to (zlib with ``max_length``, never
  more than the cap and one byte), stop at the cap (413); br and zstd are refused (415);
- every byte held counts against a `BodyBudget` shared by all requests: a request that
  would go beyond waits for nothing, it is refused at once (503, Retry-After);
- the whole body must arrive within the body deadline (408).

A body is gathered in an anonymous memory mapping of its own, unmapped with the refusal
(or after the answer): its memory goes back to the system, not to the heap. aiohttp then
discards the rest of what the client sends (its lingering close, bounded in time).
`BodyDecoder` and `BodyBudget` are plain synchronous objects; `request_body` is the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

#: Content codings the tap decodes (a body sent in another is refused with a 415).
ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")
#: Most bytes one decompression step gives out (each step's output is copied out at once).
DECODE_STEP = 256 * 1024


class BodyRefused(Exception):
    """A body the tap does not take: the status to answer and why."""

    def __init__(self, status: int, message: str, retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


def _too_large(limit: int, what: str) -> BodyRefused:
    return BodyRefused(413, f"request body {what} more than the sidecar's limit of {limit} bytes")


class BodyBudget:
    """Body bytes held at once by every request being read, and their limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> None:
        """Count `n` more bytes held; BodyRefused (503) when that would pass the limit."""
        if self.held + n > self.limit:
            raise BodyRefused(
                503,
                f"the sidecar holds {self.held} bytes of request bodies, its limit is {self.limit}: "
                "retry shortly",
                retry_after_s=1,
            )
        self.held += n

    def give_back(self, n: int) -> None:
        """`n` bytes are no longer held."""
        self.held -= n


class BodyDecoder:
    """One body's bytes as sent -> its bytes decoded, never more than `limit` of either."""

    def __init__(self, encoding: str, limit: int) -> None:
        coding = encoding.strip().lower() or "identity"
        if coding not in ENCODINGS:
            raise BodyRefused(
                415, f"content-encoding {encoding!r} is not accepted: send gzip, deflate or identity"
            )
        self._coding = coding
        self.limit = limit
        """Most bytes taken, as sent and decoded alike."""
        self.sent = 0
        """Bytes received as sent."""
        self.decoded = 0
        """Bytes given out decoded."""
        self._zlib: zlib._Decompress | None = None
        if coding in ("gzip", "x-gzip"):
            self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The decoded bytes of `chunk`; BodyRefused when a limit is passed or the coding is broken."""
        self.sent += len(chunk)
        if self.sent > self.limit:
            raise _too_large(self.limit, "is")
        if self._coding == "identity":
            self.decoded += len(chunk)
            return [chunk] if chunk else []
        if self._zlib is None:  # deflate: zlib-wrapped as RFC 9110 says, or raw as some send it
            self._zlib = zlib.decompressobj(
                zlib.MAX_WBITS if chunk[:1] and chunk[0] & 0x0F == 8 else -zlib.MAX_WBITS
            )
        out = []
        data = chunk
        while data:
            piece = self._inflate(data)
            if piece:
                out.append(piece)
            data = self._zlib.unconsumed_tail
        return out

    def _inflate(self, data: bytes) -> bytes:
        assert self._zlib is not None
        try:
            piece = self._zlib.decompress(data, min(DECODE_STEP, self.limit - self.decoded + 1))
        except zlib.error as e:
            raise BodyRefused(400, f"request body is not valid {self._coding}: {e}") from e
        if self._zlib.unused_data:
            raise BodyRefused(400, f"request body has bytes after the end of its {self._coding} stream")
        self.decoded += len(piece)
        if self.decoded > self.limit:
            raise _too_large(self.limit, "decompresses to")
        return piece

    def finish(self) -> None:
        """At the body's end: BodyRefused when its compressed stream was cut short."""
        if self.sent and self._zlib is not None and not self._zlib.eof:
            raise BodyRefused(400, f"request body's {self._coding} stream ends before its end")


@dataclass(frozen=True)
class BodyLimits:
    """How much of a body the tap takes, and for how long it waits for it."""

    max_bytes: int
    """Largest body, as sent and decoded alike."""
    timeout_s: float
    """Longest time from the request's head to its body's end."""


@contextlib.asynccontextmanager
async def request_body(
    request: web.BaseRequest, limits: BodyLimits, budget: BodyBudget
) -> AsyncIterator[bytes]:
    """``async with request_body(...) as body``: the request's body, decoded, counted against
    `budget` until the block ends; BodyRefused (400, 408, 413, 415, 503) when it is not taken."""
    declared = request.content_length
    if declared is not None and declared > limits.max_bytes:
        raise _too_large(limits.max_bytes, f"of {declared} bytes is")
    decoder = BodyDecoder(request.headers.get("Content-Encoding", ""), limits.max_bytes)
    held = [0]
    try:
        body = await _read(request, decoder, limits.timeout_s, budget, held)
        yield body
    finally:
        budget.give_back(held[0])


async def _read(
    request: web.BaseRequest, decoder: BodyDecoder, timeout_s: float, budget: BodyBudget, held: list[int]
) -> bytes:
    # The body is gathered in an anonymous mapping of its largest size: only the pages
    # written take memory, and all of it goes back to the system when the mapping is
    # closed. (Gathered on the heap, a refused body's freed memory stayed with the process:
    # glibc keeps free blocks below the heap's top, and raises its trim threshold up to
    # 64 MiB after freeing one large block.)
    with mmap.mmap(-1, decoder.limit + DECODE_STEP) as buffer:
        try:
            async with asyncio.timeout(timeout_s):
                while chunk := await request.content.readany():
                    for piece in decoder.feed(chunk):
                        budget.take(len(piece))
                        held[0] += len(piece)
                        buffer.write(piece)
                decoder.finish()
        except TimeoutError as e:
            raise BodyRefused(408, f"request body not received within {timeout_s:g} s") from e
        except HttpProcessingError as e:
            raise BodyRefused(400, f"request body is malformed: {e.message}") from e
        return buffer[: buffer.tell()]

"""HTTP/1.1 spoken over a raw socket, for requests no client library would send: any
method, path, header and body, absolute-form targets, broken chunked framing, bodies
compressed into bombs, requests that arrive a byte at a time.

`Request` renders itself with framing that is right unless told otherwise (its
Content-Length or chunks match its body, and ``Connection: close`` makes the server end
the exchange), so that every random request gets an answer to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import zlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from hypothesis import strategies as st

#: Longest a server may take to answer one request of the fuzz (a loaded 2-core machine).
ANSWER_TIMEOUT_S = 30.0


@dataclass
class Request:
    method: str = "GET"
    target: str = "/"
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    chunked: bool = False

    def render(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1", "Host: fuzz.test", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        if self.chunked:
            lines.append("Transfer-Encoding: chunked")
            half = len(self.body) // 2
            parts = [p for p in (self.body[:half], self.body[half:]) if p]
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
        else:
            lines.append(f"Content-Length: {len(self.body)}")
            body = self.body
        return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


@dataclass
class Answer:
    status: int
    """0: the connection closed without an answer."""
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def is_json_error(self) -> bool:
        """A JSON body naming an error (vLLM's shape, or aiohttp's turned JSON)."""
        with contextlib.suppress(ValueError):
            body = self.json()
            return isinstance(body, dict) and "error" in body
        return False


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def exchange(
    url: str, raw: bytes, timeout_s: float = ANSWER_TIMEOUT_S, half_close: bool = False
) -> Answer:
    """Send `raw` to the server at `url` (then end the sending side: `half_close`); read
    until it closes the connection."""
    reader, writer = await asyncio.open_connection(*host_port(url))
    try:
        writer.write(raw)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            if half_close:
                writer.write_eof()
        async with asyncio.timeout(timeout_s):
            data = b""
            with contextlib.suppress(ConnectionError):
                data = await reader.read(-1)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return parse(data)


def parse(data: bytes) -> Answer:
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1."):
        return Answer(0, {}, data)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    return Answer(int(status_line.split()[1]), headers, body)


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


@functools.cache
def gzip_bomb(decompressed_bytes: int) -> bytes:
    """Zeros gzipped: about 1,000 times smaller than what they expand to."""
    out = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (1 << 20)
    parts = [out.compress(chunk) for _ in range(decompressed_bytes >> 20)]
    return b"".join([*parts, out.flush()])


# -- strategies ----------------------------------------------------------------------------

KNOWN_PATHS = [
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics",
    "/kvferry/metrics", "/tokenize", "/detokenize", "/reset_prefix_cache", "/sleep", "/v1/",
    "/", "//v1/models", "/v1/../v1/models", "/%2e%2e/etc/passwd", "/v1/chat/completions/",
    "/" + "a" * 9000, "*",
]  # fmt: skip
HEADER_NAMES = [
    "X-Kvferry-Tenant", "X-Kvferry-Turn-Id", "X-Kvferry-No-Retention", "X-Kvferry-Not-Delivered",
    "X-Kvferry-Reused-Tokens", "X-Kvferry-Whatever", "X-Conversation-Id", "X-Session-ID",
    "X-Request-Id", "Authorization", "Content-Type", "Accept", "Accept-Encoding", "Expect",
    "Connection", "Upgrade", "TE", "Trailer", "Proxy-Authorization", "Cookie", "Range",
]  # fmt: skip
_token_chars = st.characters(codec="ascii", categories=["L", "N"], include_characters="!#$%&'*+-.^_`|~")
_header_value = st.one_of(
    st.sampled_from(
        [
            "",
            "x" * 9000,
            "default",
            "*",
            "../..",
            "1",
            "-1",
            "close",
            "100-continue",
            "Bearer ",
            "application/json",
            "gzip",
            "websocket",
            "\u00ff\u00fe",
        ]
    ),
    st.text(st.characters(codec="latin-1", exclude_characters="\r\n\x00"), max_size=60),
)
_json = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def generation_bodies(draw: st.DrawFn) -> bytes:
    """A chat or completion body: plausible (short answers), odd, or not JSON at all."""
    kind = draw(st.sampled_from(["chat", "completion", "odd_json", "deep", "bytes", "big"]))
    if kind in ("chat", "completion"):
        body: dict[str, Any] = {"max_tokens": draw(st.sampled_from([1, 4, 0, -1, "4", None, 10**12]))}
        if kind == "chat":
            body["messages"] = draw(
                st.one_of(st.just([{"role": "user", "content": "Tell me about ferries."}]), _json)
            )
        else:
            body["prompt"] = draw(st.one_of(st.just("Tell me about ferries."), _json))
        body.update(draw(st.dictionaries(st.sampled_from(_BODY_KEYS), _json, max_size=3)))
        return json.dumps(body, allow_nan=True).encode()
    if kind == "odd_json":
        return json.dumps(draw(_json), allow_nan=True).encode()
    if kind == "deep":
        depth = draw(st.integers(100, 5000))
        return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "big":
        return json.dumps({"prompt": "ferry " * draw(st.integers(10_000, 200_000)), "max_tokens": 1}).encode()
    return draw(st.binary(max_size=300))


_BODY_KEYS = [
    "stream", "stream_options", "conversation_id", "session_id", "user", "model", "n", "echo",
    "kv_transfer_params", "return_token_ids", "logprobs", "temperature", "seed", "tools", "messages",
]  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """Any method, path, headers and body, framed right; now and then a Content-Encoding
    the body does not have."""
    method = draw(st.one_of(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]),
                            st.text(_token_chars, min_size=1, max_size=12)))  # fmt: skip
    target = draw(
        st.one_of(st.sampled_from(KNOWN_PATHS), st.text(_token_chars, max_size=40).map(lambda t: "/" + t))
    )
    if draw(st.booleans()):
        target += "?" + draw(st.text(_token_chars, max_size=30))
    names = st.one_of(st.sampled_from(HEADER_NAMES), st.text(_token_chars, min_size=1, max_size=20))
    headers = draw(st.lists(st.tuples(names, _header_value), max_size=5))
    headers = [(n, v) for n, v in headers if n.lower() not in _FRAMING]
    body = draw(generation_bodies()) if draw(st.booleans()) else b""
    encodings = ["identity", "identity", "gzip", "deflate", "lying"]
    encoding = draw(st.sampled_from(encodings))
    if encoding == "gzip":
        body, headers = gzip.compress(body), [*headers, ("Content-Encoding", "gzip")]
    elif encoding == "deflate":
        body, headers = zlib.compress(body), [*headers, ("Content-Encoding", "deflate")]
    elif encoding == "lying":
        headers = [
            *headers,
            ("Content-Encoding", draw(st.sampled_from(["gzip", "deflate", "br", "zstd", "x"]))),
        ]
    return Request(method, target, headers, body, chunked=draw(st.booleans()))


#: Headers a request's framing owns (set by `Request.render`).
_FRAMING = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "expect"}

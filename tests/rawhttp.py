"""HTTP spoken on a raw socket, for the tests of kvferry's front doors (the sidecar's tap,
the router): an answer read as bytes, and the slow and idle clients their connection
guard (kvferry.serving) must time out."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from kvferry.tasks import cancel_and_wait


@dataclass
class Raw:
    """An answer read off a raw socket."""

    status: int
    headers: dict[str, str]
    body: Any
    closed: bool


async def read_answer(reader: asyncio.StreamReader) -> Raw:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    closed = headers.get("connection", "").lower() == "close"
    return Raw(int(lines[0].split()[1]), headers, json.loads(body) if body else None, closed)


async def raw(url: str, data: bytes) -> Raw:
    """Send `data` on a new connection, read one answer and see the connection end."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        answer = await asyncio.wait_for(read_answer(reader), 10)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed after it
        return answer
    finally:
        writer.close()


async def slow_clients_are_timed_out(url: str, idle_path: str) -> None:
    """At `url`, served with head and body timeouts of 0.5 s and an idle timeout: a head
    sent a byte at a time, a body that never ends, a connection that sends nothing and one
    idle after its answer (to GET `idle_path`) are each answered or closed in time."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    # A head sent a byte at a time, for ever: a 408 once the head timeout is over.
    reader, writer = await asyncio.open_connection(host, int(port))
    trickle = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def drip() -> None:
        for byte in trickle:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)  # (the slow client: its pace, not a wait for the server)

    dripping = asyncio.create_task(drip())
    answer = await asyncio.wait_for(read_answer(reader), 10)
    assert answer.status == 408 and answer.closed
    assert answer.body["error"]["message"] == "request head not received within 0.5 s"
    assert await asyncio.wait_for(reader.read(), 10) == b"" and loop.time() - began < 5
    await cancel_and_wait([dripping])
    writer.close()
    # A body that never ends: a 408.
    slow_body = await raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert slow_body.status == 408
    assert slow_body.body["error"]["message"] == "request body not received within 0.5 s"
    # A connection that sends nothing is closed; so is one idle after an answer.
    reader, writer = await asyncio.open_connection(host, int(port))
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {idle_path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    answer = await asyncio.wait_for(read_answer(reader), 10)
    assert answer.status == 200 and not answer.closed
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()

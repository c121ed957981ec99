"""Slow and idle clients of the router's front door are timed out, as the sidecar's are
(issue 21): a head sent a byte at a time, a body that never ends, a connection that
sends nothing or stays idle after an answer. Held open, each kept a socket, and enough
of them the router's file descriptors."""

from __future__ import annotations

import asyncio

from controlplane.daemon import Daemon
from kvferry.tasks import cancel_and_wait
from router import Router
from tests.router.fakes import fake_engine, on_fakes
from tests.sidecar.test_hardening import _raw, _read_answer


async def test_slow_heads_and_bodies_and_idle_connections_are_timed_out(daemon: Daemon) -> None:
    timeouts = {"server__head_timeout_s": 0.5, "server__body_timeout_s": 0.5, "server__idle_timeout_s": 1.0}
    async with fake_engine() as p, fake_engine() as d, Router(on_fakes(daemon, p, d, **timeouts)) as router:
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        # A head sent a byte at a time, for ever: a 408 once the head timeout is over.
        reader, writer = await asyncio.open_connection(host, int(port))
        trickle = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        loop = asyncio.get_running_loop()
        began = loop.time()

        async def drip() -> None:
            for byte in trickle:
                writer.write(bytes([byte]))
                await asyncio.sleep(0.05)  # (the slow client: its pace, not a wait for the router)

        dripping = asyncio.create_task(drip())
        answer = await asyncio.wait_for(_read_answer(reader), 10)
        assert answer.status == 408 and answer.closed
        assert await asyncio.wait_for(reader.read(), 10) == b"" and loop.time() - began < 5
        await cancel_and_wait([dripping])
        writer.close()
        # A body that never ends: a 408.
        slow_body = await _raw(
            router.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        )
        assert slow_body.status == 408
        assert slow_body.body["error"]["message"] == "request body not received within 0.5 s"
        # A connection that sends nothing is closed; so is one idle after an answer.
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(_read_answer(reader), 10)
        assert answer.status == 200 and not answer.closed
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()

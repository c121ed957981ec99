"""The router's and the sidecar's HTTP under random and hostile requests, over a raw
socket: any method, path, header (X-Kvferry-* among them) and body (not JSON, nested
thousands deep, megabytes, gzip and deflate, lying about its encoding, chunked), then
hand-made ones (absolute-form targets, broken chunked framing, requests sent a byte at a
time and never finished).

Every answer is a valid one or a 4xx/5xx error, never a 500 from a Python exception; the
process, in its own process, logs no error and serves a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import pytest
import yarl
from hypothesis import given

from tests.fuzz.campaign import fuzz
from tests.fuzz.processes import Deployment, Proc
from tests.fuzz.rawhttp import Answer, Request, exchange, host_port, requests

#: aiohttp's HTTP parser refuses these before any application code runs, as text/plain
#: (a request line or header too long, a body past the limit while framing, bad framing).
PARSER_REFUSALS = frozenset({400, 413, 414, 431})
CHAT = '{"messages": [{"role": "user", "content": "Tell me about ferries."}], "max_tokens": 2}'


def check_answer(answer: Answer, request: Request | bytes, where: str) -> None:
    """An answer (not a dropped connection); an error is one of the client's making, in
    JSON unless aiohttp's parser gave it; never a 500."""
    what = request if isinstance(request, bytes) else request.render()[:300]
    assert answer.status, (where, "no answer", what)
    assert answer.status != 500, (where, answer.body[:300], what)
    if answer.status >= 400 and not (isinstance(request, Request) and request.method == "HEAD"):
        plain = answer.headers.get("content-type", "").startswith("text/plain")
        parser = answer.status in PARSER_REFUSALS and plain
        assert parser or answer.is_json_error(), (where, answer.status, answer.body[:300], what)


def errors_logged(proc: Proc) -> list[dict[str, Any]]:
    return [e for e in proc.logs() if e.get("level") in ("error", "critical") or "exception" in e]


async def serves_a_turn(url: str) -> None:
    raw = Request("POST", "/v1/chat/completions", [("Content-Type", "application/json")], CHAT.encode())
    answer = await exchange(url, raw.render())
    assert answer.status == 200 and answer.json()["choices"], (answer.status, answer.body[:300])


async def still_serving(proc: Proc, url: str) -> None:
    assert proc.alive(), f"{proc.name} died:\n{proc.log_tail()}"
    await serves_a_turn(url)
    assert not errors_logged(proc), errors_logged(proc)[:3]


@pytest.fixture
async def router(live: Deployment) -> Any:
    yield live.router, live.router_url
    await still_serving(live.router, live.router_url)


@pytest.fixture
async def sidecar(live: Deployment) -> Any:
    yield live.sidecar, live.sidecar_url
    await still_serving(live.sidecar, live.sidecar_url)


@fuzz(40)
@given(request=requests())
async def test_the_router_answers_any_request_properly(router: tuple[Proc, str], request: Request) -> None:
    check_answer(await exchange(router[1], request.render()), request, "router")


@fuzz(40)
@given(request=requests())
async def test_the_sidecar_answers_any_request_properly(
    live: Deployment, sidecar: tuple[Proc, str], request: Request
) -> None:
    """As the router, except that what the engine answers passes through as it is (the
    emulator's errors are aiohttp's text, as a vLLM's are FastAPI's): an error that is not
    JSON must be the engine's own answer to the same request."""
    answer = await exchange(sidecar[1], request.render())
    if answer.status >= 400 and not answer.is_json_error():
        engines = await exchange(live.engine_url, as_forwarded(request).render())
        if engines.status == answer.status:
            return
    check_answer(answer, request, "sidecar")


def as_forwarded(request: Request) -> Request:
    """`request` as the sidecar's HTTP client sends it on: its target's dot segments
    resolved ("/v1/../v1/models" reaches the engine as "/v1/models")."""
    if not request.target.startswith("/"):
        return request
    target = yarl.URL("http://engine" + request.target).raw_path_qs
    return dataclasses.replace(request, target=target)


def undecodable_bodies() -> list[Request]:
    """Generation requests whose body is not what their Content-Encoding says."""
    headers = [("Content-Type", "application/json")]
    return [
        Request("POST", "/v1/chat/completions", [*headers, ("Content-Encoding", encoding)], CHAT.encode())
        for encoding in ("gzip", "deflate")
    ]


async def test_the_router_refuses_a_body_that_does_not_decode(router: tuple[Proc, str]) -> None:
    """It answered 500, "internal router error", logging a crash."""
    for request in undecodable_bodies():
        answer = await exchange(router[1], request.render())
        assert answer.status == 400 and "does not decode" in answer.json()["error"]["message"], answer


async def test_the_sidecar_refuses_a_body_that_does_not_decode(sidecar: tuple[Proc, str]) -> None:
    for request in undecodable_bodies():
        answer = await exchange(sidecar[1], request.render())
        assert answer.status == 400 and answer.is_json_error(), answer


ABSOLUTE_FORM = [
    f"{method} {target} HTTP/1.1\r\nHost: fuzz.test\r\nConnection: close\r\n"
    f"Content-Type: application/json\r\nContent-Length: {len(CHAT)}\r\n\r\n{CHAT}".encode()
    for method, target in [
        ("POST", "http://evil.test/v1/chat/completions"),
        ("POST", "http://169.254.169.254/latest/meta-data"),
        ("GET", "https://evil.test:8443/v1/models"),
        ("GET", "http://127.0.0.1:1/health"),
        ("CONNECT", "evil.test:443"),
    ]
]


async def test_absolute_form_targets_get_an_error_or_their_path(router: tuple[Proc, str]) -> None:
    """A proxy's request line (`POST http://evil.test/... HTTP/1.1`) to the router: an error
    or the answer its path would get; never a request to the host it names."""
    for raw in ABSOLUTE_FORM:
        check_answer(await exchange(router[1], raw), raw, "router")


async def test_absolute_form_targets_get_400_from_the_sidecar(sidecar: tuple[Proc, str]) -> None:
    for raw in ABSOLUTE_FORM:
        answer = await exchange(sidecar[1], raw)
        assert answer.status == 400 and answer.is_json_error(), (raw[:60], answer)


BROKEN_CHUNKS = [
    b"zz\r\n{}\r\n0\r\n\r\n",  # not a size
    b"-5\r\n{}\r\n0\r\n\r\n",  # negative
    b"ffffffffffffffffff\r\n{}\r\n0\r\n\r\n",  # beyond 64 bits
    b"2\r\n{}}}}}\r\n0\r\n\r\n",  # longer than its size
    b"10\r\n{}\r\n0\r\n\r\n",  # shorter than its size (what follows is data; then the end)
    b"2;" + b"x" * 9000 + b"\r\n{}\r\n0\r\n\r\n",  # an extension too long
    b"2\r\n{}\r\n0\r\nX-Trailer: " + b"y" * 9000 + b"\r\n\r\n",  # a trailer too long
]


@pytest.mark.parametrize("which", ["router", "sidecar"])
async def test_broken_chunked_framing_is_refused(live: Deployment, which: str) -> None:
    """Bad chunk sizes and lines: a 4xx, or the connection closed; never a 500."""
    url = live.router_url if which == "router" else live.sidecar_url
    head = b"POST /v1/completions HTTP/1.1\r\nHost: fuzz.test\r\nConnection: close\r\n"
    head += b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    for chunks in BROKEN_CHUNKS:
        answer = await exchange(url, head + chunks, half_close=True)
        assert answer.status != 500 and (answer.status == 0 or answer.status >= 400), (chunks[:40], answer)
    proc = live.router if which == "router" else live.sidecar
    await still_serving(proc, url)


#: Connections held open, their requests never finished (slowloris).
SLOW_CLIENTS = 64


@pytest.mark.parametrize("which", ["router", "sidecar"])
async def test_slow_and_unfinished_requests_do_not_stop_others(live: Deployment, which: str) -> None:
    """Clients that send a request a few bytes at a time and never finish it (headers or
    body): everyone else is still served meanwhile, and after they go."""
    url = live.router_url if which == "router" else live.sidecar_url
    proc = live.router if which == "router" else live.sidecar
    unfinished = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz.test\r\nX-Kvferry-Tenant: a",
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"messages"',
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n100\r\n{",
        b"GET /health HTT",
    ]
    writers: list[asyncio.StreamWriter] = []
    try:
        for i in range(SLOW_CLIENTS):
            _, writer = await asyncio.open_connection(*host_port(url))
            writers.append(writer)
            raw = unfinished[i % len(unfinished)]
            for at in range(0, len(raw), 7):  # a few bytes at a time
                writer.write(raw[at : at + 7])
                await writer.drain()
        await serves_a_turn(url)
        for writer in writers:  # one more trickle each: still held open
            with contextlib.suppress(ConnectionError):
                writer.write(b"x")
                await writer.drain()
        await serves_a_turn(url)
    finally:
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    await still_serving(proc, url)

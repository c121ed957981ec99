"""The tap's hardening (issue 21, item 5): paths, targets, body caps, deadlines.

The decisions (`sidecar.paths`, `sidecar.bodies`) are tested as plain functions; the
refusals over real HTTP, many with a raw socket (to send what a client library would
not: an absolute-form target, a head a byte at a time, a body that never ends).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import aiohttp
import pytest
import structlog

from sidecar.bodies import BodyBudget, BodyDecoder, BodyRefused
from sidecar.paths import Access, Refusal, Route, route_of
from tests.polling import eventually
from tests.rawhttp import raw, read_answer, slow_clients_are_timed_out
from tests.sidecar.conftest import EchoEngine, StartTap

LIMIT = 64 * 1024


# -- the path table ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target", "access"),
    [
        ("POST", "/v1/chat/completions", Access.SERVE),
        ("POST", "/v1/completions?trace=1", Access.SERVE),
        ("GET", "/v1/models", Access.SERVE),
        ("HEAD", "/health", Access.SERVE),
        ("POST", "/tokenize", Access.SERVE),
        ("GET", "/version", Access.SERVE),
        ("GET", "/metrics", Access.OBSERVE),
        ("GET", "/kvferry/metrics", Access.OBSERVE),
        ("POST", "/reset_prefix_cache", Access.ADMIN),
        ("POST", "/collective_rpc", Access.ADMIN),
        ("POST", "/sleep", Access.ADMIN),
        ("POST", "/start_profile", Access.ADMIN),
    ],
)
def test_served_paths_and_who_may_call_them(method: str, target: str, access: Access) -> None:
    route = route_of(method, target)
    assert isinstance(route, Route) and route.access is access
    assert route.local is (target == "/kvferry/metrics")


@pytest.mark.parametrize(
    ("method", "target", "status", "words"),
    [
        ("POST", "http://evil/v1/completions", 400, "not in origin form"),
        ("CONNECT", "evil:443", 400, "not in origin form"),
        ("OPTIONS", "*", 400, "not in origin form"),
        ("GET", "//evil/v1/models", 400, "not in origin form"),
        ("POST", "/anything/else", 404, "'/anything/else' is not served"),
        ("POST", "/reset%5Fprefix%5Fcache", 404, "is not served"),  # (matched as sent, never decoded)
        ("POST", "/v1/completions/../../reset_prefix_cache", 404, "is not served"),
        ("POST", "/v1/completions/", 404, "is not served"),
        ("GET", "/v1/chat/completions", 405, "method GET is not allowed on /v1/chat/completions"),
        ("DELETE", "/v1/models", 405, "(allowed: GET, HEAD)"),
    ],
)
def test_targets_refused(method: str, target: str, status: int, words: str) -> None:
    refusal = route_of(method, target)
    assert isinstance(refusal, Refusal) and refusal.status == status and words in refusal.message
    assert bool(refusal.allow) is (status == 405)


# -- body decoding and the budget -----------------------------------------------------------


def _decode(encoding: str, data: bytes, step: int = 1000) -> bytes:
    decoder = BodyDecoder(encoding, LIMIT)
    out = b"".join(b"".join(decoder.feed(data[at : at + step])) for at in range(0, len(data), step))
    decoder.finish()
    return out


def test_bodies_decode_in_every_accepted_coding() -> None:
    body = json.dumps({"prompt": "ferry " * 2000}).encode()
    assert _decode("", body) == body and _decode("identity", body) == body
    assert _decode("gzip", gzip.compress(body)) == body and _decode("X-Gzip", gzip.compress(body)) == body
    assert _decode("deflate", zlib.compress(body)) == body  # zlib-wrapped, as RFC 9110 says
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert _decode("deflate", raw.compress(body) + raw.flush()) == body  # raw, as some send it
    assert _decode("gzip", b"") == b""


@pytest.mark.parametrize(
    ("encoding", "data", "status", "words"),
    [
        (
            "identity",
            bytes(LIMIT + 1),
            413,
            f"request body is more than the sidecar's limit of {LIMIT} bytes",
        ),
        ("gzip", gzip.compress(bytes(LIMIT + 1), mtime=0), 413, "request body decompresses to more than"),
        ("deflate", zlib.compress(bytes(100 * LIMIT)), 413, "decompresses to more than"),
        ("gzip", gzip.compress(b"{}", mtime=0)[:-12], 400, "gzip stream ends before its end"),
        ("gzip", gzip.compress(b"{}", mtime=0) + b"more", 400, "bytes after the end of its gzip stream"),
        ("gzip", b"\x1f\x8b not gzip at all", 400, "request body is not valid gzip"),
        ("br", b"\x0b", 415, "content-encoding 'br' is not accepted: send gzip, deflate or identity"),
        ("gzip, gzip", b"", 415, "is not accepted"),
    ],
)
def test_bodies_refused(encoding: str, data: bytes, status: int, words: str) -> None:
    with pytest.raises(BodyRefused) as refused:
        _decode(encoding, data, step=len(data) or 1)
    assert refused.value.status == status and words in refused.value.message


def test_a_bomb_is_never_inflated_past_the_limit() -> None:
    bomb = gzip.compress(bytes(1000 * LIMIT))  # (64 MB of zeros in 64 kB)
    decoder = BodyDecoder("gzip", LIMIT)
    with pytest.raises(BodyRefused):
        decoder.feed(bomb)
    assert LIMIT < decoder.decoded <= LIMIT + 1


def test_the_budget_refuses_what_would_pass_it() -> None:
    budget = BodyBudget(100)
    budget.take(60)
    with pytest.raises(BodyRefused) as refused:
        budget.take(41)
    assert refused.value.status == 503 and refused.value.retry_after_s == 1
    assert "holds 60 bytes of request bodies, its limit is 100" in refused.value.message
    budget.give_back(60)
    budget.take(100)
    assert budget.held == 100


# -- over HTTP ---------------------------------------------------------------------------


async def test_absolute_form_and_unknown_targets_never_reach_the_engine(
    start_tap: StartTap, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    sc = await start_tap()
    for target in ("http://evil/v1/completions", "http://127.0.0.1/v1/completions"):
        answer = await raw(
            sc.url, f"POST {target} HTTP/1.1\r\nHost: evil\r\nContent-Length: 2\r\n\r\n{{}}".encode()
        )
        assert answer.status == 400 and answer.closed
        assert answer.body["error"]["message"].endswith(
            "is not in origin form (/path?query): absolute-form targets are not served"
        )
    async with http.post(sc.url + "/start_profilex") as r:
        assert r.status == 404 and (await r.json())["error"] == {
            "message": "path '/start_profilex' is not served by the sidecar",
            "type": "NotFound",
            "param": None,
            "code": 404,
        }
    async with http.get(sc.url + "/tokenize") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert (await r.json())["error"][
            "message"
        ] == "method GET is not allowed on /tokenize (allowed: POST)"
    assert echo.seen == []
    async with http.post(sc.url + "/v1/completions?x=1", json={"prompt": "hi"}) as r:
        assert r.status == 200
    assert echo.seen == ["POST /v1/completions?x=1"]


async def test_administrative_paths_are_an_admins_and_development_callers_are(
    start_tap: StartTap, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    sc = await start_tap()
    with structlog.testing.capture_logs() as logs:
        async with http.post(sc.url + "/reset_prefix_cache") as r:
            assert r.status == 200
    assert echo.seen == ["POST /reset_prefix_cache"]
    allowed = [e for e in logs if e["event"] == "audit.allowed"]
    assert allowed and allowed[0]["action"] == "POST /reset_prefix_cache"
    assert allowed[0]["identity"] == "development" and allowed[0]["role"] == "admin"


async def test_oversized_bodies_are_refused_with_413(start_tap: StartTap, echo: EchoEngine) -> None:
    sc = await start_tap(tap__max_body_bytes=LIMIT)
    declared = await raw(
        sc.url, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {10**9}\r\n\r\n".encode()
    )
    assert declared.status == 413 and declared.closed
    assert declared.body["error"]["message"] == (
        f"request body of {10**9} bytes is more than the sidecar's limit of {LIMIT} bytes"
    )
    chunk = bytes(LIMIT // 2)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    sent = await raw(
        sc.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    )
    assert sent.status == 413 and "request body is more than" in sent.body["error"]["message"]
    bomb = gzip.compress(bytes(100 * LIMIT))
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        f"Content-Length: {len(bomb)}\r\n\r\n"
    )
    inflated = await raw(sc.url, head.encode() + bomb)
    assert (
        inflated.status == 413
        and "request body decompresses to more than" in inflated.body["error"]["message"]
    )
    br = await raw(
        sc.url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx",
    )
    assert br.status == 415 and "'br' is not accepted" in br.body["error"]["message"]
    assert echo.seen == []


async def test_bodies_beyond_the_budget_are_refused_with_503(
    start_tap: StartTap, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    sc = await start_tap(tap__max_body_bytes=LIMIT, tap__max_bodies_bytes=LIMIT)
    assert sc.tap is not None
    host, port = sc.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"prompt": "' + b"x" * 50_000 + b'"}'
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
    writer.write(body[:40_000])  # (the rest later: the tap holds these meanwhile)
    tap = sc.tap

    async def held() -> bool:
        return tap.bodies.held >= 40_000

    await eventually(held)
    async with http.post(sc.url + "/v1/completions", data=b"y" * 30_000) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (
            "holds 40000 bytes of request bodies, its limit is 65536" in (await r.json())["error"]["message"]
        )
    writer.write(body[40_000:])
    answer = await asyncio.wait_for(read_answer(reader), 10)
    writer.close()
    assert answer.status == 200 and json.loads(answer.body["body"]) == json.loads(body)
    assert tap.bodies.held == 0


async def test_slow_heads_and_bodies_and_idle_connections_are_timed_out(start_tap: StartTap) -> None:
    sc = await start_tap(tap__head_timeout_s=0.5, tap__body_timeout_s=0.5, tap__idle_timeout_s=1.0)
    await slow_clients_are_timed_out(sc.url, "/health")

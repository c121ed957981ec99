"""Refused bodies leave no memory behind: a sidecar process's resident memory, measured.

The finding (issue 21): 8 bodies of 70 MB refused with 413 kept +595 MB, 24 gzip bombs
of 4.5 MB left 10.4 GB resident. Here a real ``kvferry sidecar`` process (no engine, no
daemon: a refused body reaches neither) takes the same, and its VmRSS and VmHWM (peak)
are read from /proc before and after.

Stated bounds: after all of it, the process holds at most `KEPT_BOUND` more than
before; at no time did it hold more than `PEAK_BOUND` more (the bodies budget, 256 MiB,
and the copies of bodies being decoded on top of it).
"""

from __future__ import annotations

import asyncio
import io
import sys
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from realvllm.process import free_port, stop_child
from tests.polling import eventually

MIB = 1024 * 1024
KEPT_BOUND = 48 * MIB
PEAK_BOUND = 640 * MIB
BODY = 70 * 1000 * 1000
BOMB = 4_500_000

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process `pid`, bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def gzip_bomb(size: int) -> bytes:
    """A gzip stream of `size` bytes that inflates to about 1000 times as much (16 MiB of zeros
    compressed once, the compressor's state reset after it, and the same bytes repeated)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(16 * MIB)
    head = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    return head + block * ((size - len(head)) // len(block))


@pytest.fixture
async def sidecar_process() -> AsyncIterator[tuple[int, str]]:
    """A sidecar process with nothing behind it -> (pid, its URL)."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.cli", "--log-level", "error",
        "--engine-url", f"http://127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{port}",
        "--daemon", f"127.0.0.1:{free_port()}", "--engine-id", "memory",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def serving() -> bool:
                try:
                    async with http.get(url + "/kvferry/metrics") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(serving, within=20)
        yield proc.pid, url
    finally:
        await stop_child(proc, 10)


async def _post(http: aiohttp.ClientSession, url: str, data: object, headers: dict[str, str]) -> int:
    async with http.post(url + "/v1/completions", data=data, headers=headers) as r:
        body = await r.json()
        assert body["error"]["code"] == r.status
        return r.status


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for at in range(0, len(body), MIB):
        yield bytes(view[at : at + MIB])


async def test_refused_bodies_and_bombs_leave_no_memory(sidecar_process: tuple[int, str]) -> None:
    pid, url = sidecar_process
    body = bytes(BODY)
    bomb = gzip_bomb(BOMB)
    assert len(bomb) > BOMB * 0.99
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        assert await _post(http, url, b"{", {}) == 502  # (warm: a small body read, no engine)
        rss0, _ = memory(pid)
        declared = await asyncio.gather(*(_post(http, url, io.BytesIO(body), {}) for _ in range(8)))
        assert declared == [413] * 8  # refused on their Content-Length, unread
        chunked = await asyncio.gather(*(_post(http, url, _chunks(body), {}) for _ in range(8)))
        assert set(chunked) <= {413, 503} and 413 in chunked  # (503: the bodies budget was full)
        gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        bombs = await asyncio.gather(*(_post(http, url, io.BytesIO(bomb), gz) for _ in range(24)))
        assert set(bombs) <= {413, 503} and 413 in bombs
    rss1, hwm1 = memory(pid)
    print(
        f"sidecar RSS before {rss0 / MIB:.0f} MiB, after {rss1 / MIB:.0f} MiB "
        f"(kept {(rss1 - rss0) / MIB:+.0f} MiB), peak {(hwm1 - rss0) / MIB:+.0f} MiB over the start; "
        f"chunked {chunked.count(413)}x413 {chunked.count(503)}x503, "
        f"bombs {bombs.count(413)}x413 {bombs.count(503)}x503"
    )
    assert rss1 - rss0 <= KEPT_BOUND
    assert hwm1 - rss0 <= PEAK_BOUND

"""The router's and the sidecar's memory under bodies they must refuse: bodies past their
64 MiB limit, and gzip bombs that decompress past it. Refused (413), such a body must not
stay in memory (issue 21: a sidecar kept +595 MiB after 8 bodies of 70 MB, and 10.4 GiB
after 24 gzip bombs of 4.5 MB). Each process is measured by its resident memory (VmRSS);
the sidecar tested is one of the test's own (what it keeps would stay for the session)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from realvllm.process import free_port
from tests.fuzz.processes import Deployment, Proc, node_alive, sidecar_argv
from tests.fuzz.rawhttp import Request, exchange, gzip_bomb
from tests.fuzz.test_http import serves_a_turn

#: What each process accepts at most (its default --max-body-bytes).
BODY_LIMIT = 64 * 1024 * 1024
#: Resident memory a process may gain over the refused bodies it gets (2 kept bodies of the
#: limit would be as much).
MEMORY_BOUND_KIB = 128 * 1024


@pytest.fixture
def own_sidecar(live: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str]]:
    port = free_port()
    argv = sidecar_argv(live.engine_url, port, live.daemon_address, "fuzz-memory")
    proc = Proc("sidecar-memory", argv, tmp_path_factory.mktemp("sidecar-memory"))
    proc.start()
    try:
        proc.wait(node_alive(live.daemon_address, "fuzz-memory"))
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


async def refused_bodies(proc: Proc, url: str, oversized: int, bombs: int) -> tuple[int, int]:
    """Send `oversized` bodies 6 MiB past the limit and `bombs` gzip bombs (each ~250 KB,
    expanding to twice the limit); each must get 413 or 400 (or the connection closed).
    -> resident memory (KiB) before them (after one of each, to warm up) and after."""
    big = Request(
        "POST", "/v1/completions", [("Content-Type", "application/json")], b" " * (BODY_LIMIT + 6 * 2**20)
    )
    bomb_body = gzip_bomb(2 * BODY_LIMIT)
    bomb = Request(
        "POST",
        "/v1/completions",
        [("Content-Type", "application/json"), ("Content-Encoding", "gzip")],
        bomb_body,
    )

    async def refused(request: Request) -> None:
        answer = await exchange(url, request.render())
        assert answer.status in (400, 413) or answer.status == 0, (answer.status, answer.body[:200])

    await serves_a_turn(url)
    await refused(big)
    await refused(bomb)
    before = proc.rss_kib()
    for _ in range(oversized):
        await refused(big)
    for _ in range(bombs):
        await refused(bomb)
    await asyncio.sleep(0.5)
    await serves_a_turn(url)
    return before, proc.rss_kib()


async def test_the_router_keeps_no_refused_body(live: Deployment) -> None:
    before, after = await refused_bodies(live.router, live.router_url, oversized=2, bombs=2)
    print(f"router VmRSS {before} -> {after} KiB")
    assert after - before < MEMORY_BOUND_KIB, (before, after)


async def test_the_sidecar_keeps_no_refused_body(own_sidecar: tuple[Proc, str]) -> None:
    before, after = await refused_bodies(*own_sidecar, oversized=2, bombs=2)
    print(f"sidecar VmRSS {before} -> {after} KiB")
    assert after - before < MEMORY_BOUND_KIB, (before, after)

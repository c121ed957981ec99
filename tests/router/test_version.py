"""GET /version, as vLLM serves it (its multi-turn benchmark asks for it)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

import kvferry
from router import Router
from router.http_api import version_of
from tests.conftest import serve_app
from tests.router.conftest import MakeStack, router_settings
from tests.router.fakes import fake_engine


async def test_version_is_the_engines_as_vllm_answers_it(http: aiohttp.ClientSession) -> None:
    """vLLM 0.32 answers {"version": "0.32.0"}: the router answers the version of the engines
    behind it, and its own beside it."""
    async with fake_engine() as p, fake_engine() as d:
        p.version = d.version = "0.32.0"
        settings = router_settings(None, nodes__prefill_urls=(p.url,), nodes__decode_urls=(d.url,))
        async with Router(settings) as router, http.get(router.url + "/version") as r:
            assert r.status == 200 and r.content_type == "application/json"
            assert await r.json() == {"version": "0.32.0", "kvferry_version": kvferry.__version__}


async def test_version_is_kvferrys_when_no_engine_reports_one(http: aiohttp.ClientSession) -> None:
    """Engines that answer no version (404, or something else), or none reachable: the
    router's own version, never an error."""
    async with fake_engine() as p, fake_engine() as d:  # (no /version route: 404)
        settings = router_settings(None, nodes__prefill_urls=(p.url,), nodes__decode_urls=(d.url,))
        async with Router(settings) as router, http.get(router.url + "/version") as r:
            assert r.status == 200
            assert await r.json() == {"version": kvferry.__version__, "kvferry_version": kvferry.__version__}

    async def odd_version(request: web.Request) -> web.Response:
        return web.json_response({"version": 32})

    odd = web.Application()
    odd.router.add_get("/version", odd_version)
    async with serve_app(odd) as url:
        settings = router_settings(
            None, nodes__prefill_urls=(url,), nodes__decode_urls=(url,), nodes__model="m"
        )
        async with Router(settings) as router, http.get(router.url + "/version") as r:
            assert (await r.json())["version"] == kvferry.__version__


def test_version_of_reads_only_a_version_string() -> None:
    assert version_of({"version": "0.32.0"}) == "0.32.0"
    for answer in ({"version": 32}, {"version": ""}, {}, ["0.32.0"], None, "0.32.0"):
        assert version_of(answer) == ""


async def test_version_passes_the_sidecar(make_stack: MakeStack, http: aiohttp.ClientSession) -> None:
    """Discovered nodes are asked through their sidecars, which relay /version to the engine."""
    stack = await make_stack()
    router = await stack.router()
    [p] = stack.prefills
    async with http.get(p.http_url + "/version") as r:
        engine = version_of(await r.json()) if r.status == 200 else ""
    async with http.get(router.url + "/version") as r:
        assert r.status == 200
        assert await r.json() == {
            "version": engine or kvferry.__version__,
            "kvferry_version": kvferry.__version__,
        }

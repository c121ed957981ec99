"""What the router benchmarks (bench.router, bench.real_vllm) share: the paths' bodies and
headers, reading a streamed answer's first token and text, the stand-in for vLLM's
example multi-turn proxy, prompts of filler text, and the router's stage totals."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from realvllm.process import free_port
from router import Router

CHAT = "/v1/chat/completions"


FRESH = {"do_remote_decode": True, "do_remote_prefill": False}


JSON = {"Content-Type": "application/json"}


async def first_token(
    response: aiohttp.ClientResponse, t0: float, seen: Callable[[dict[str, Any]], None] | None = None
) -> tuple[float, int, str]:
    """Seconds to the first content token of a stream, the prompt tokens (when reported), the
    text. `seen` is handed every event."""
    ttft, prompt = 0.0, 0
    text: list[str] = []
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if seen is not None:
            seen(event)
        if event.get("usage"):
            prompt = event["usage"]["prompt_tokens"]
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                if not ttft:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    return ttft, prompt, "".join(text)


class MultiturnProxyStandIn:
    """The per-request structure of vLLM's example multi-turn P/D proxy, on aiohttp."""

    def __init__(self, p_url: str, d_url: str) -> None:
        self.p_url, self.d_url = p_url, d_url
        self.cache: dict[str, dict[str, Any]] = {}
        self.http: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
        req = json.loads(await request.read())
        conversation = req.pop("conversation_id", "")
        cached = self.cache.pop(conversation, None) if conversation else None
        req["kv_transfer_params"] = {**cached, **FRESH} if cached else dict(FRESH)
        payload = dict(req)
        payload.update(stream=False, max_tokens=1)
        for name in ("max_completion_tokens", "min_tokens", "stream_options"):
            payload.pop(name, None)
        headers = {"Content-Type": "application/json"}
        async with self.http.post(self.p_url + CHAT, data=json.dumps(payload), headers=headers) as r:
            answer = json.loads(await r.read())
        if answer.get("kv_transfer_params"):
            req["kv_transfer_params"] = answer["kv_transfer_params"]
        if not req.get("stream"):  # (vLLM 0.32 returns D's params only in a JSON answer)
            async with self.http.post(self.d_url + CHAT, data=json.dumps(req), headers=headers) as r:
                raw = await r.read()
                status = r.status
            answer = json.loads(raw)
            if answer.get("kv_transfer_params") and conversation:
                self.cache[conversation] = answer["kv_transfer_params"]
            return web.Response(body=raw, status=status, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with self.http.post(
            self.d_url + CHAT, data=json.dumps({**req, "stream": True}), headers=headers
        ) as r:
            async for raw in r.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("kv_transfer_params") and conversation:
                        self.cache[conversation] = chunk["kv_transfer_params"]
                await resp.write((line + "\n").encode())
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        app = web.Application()
        app.router.add_post(CHAT, self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.http is not None:
            await self.http.close()


STAGES = ("tokenize", "digests", "lookup")
"""The router's stages of the reuse path, as its kvferry_router_stage_seconds label them."""


def stage_totals(router: Router) -> dict[str, tuple[float, float]]:
    """(seconds, count) of each router stage so far."""
    reg = router.metrics.registry
    return {
        stage: (
            reg.get_sample_value("kvferry_router_stage_seconds_sum", {"stage": stage}) or 0.0,
            reg.get_sample_value("kvferry_router_stage_seconds_count", {"stage": stage}) or 0.0,
        )
        for stage in STAGES
    }


async def stage_seconds(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Seconds each stage (`STAGES`) took so far in the router at `url` (one in a process of
    its own: `bench.parts`), from its /metrics."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out = dict.fromkeys(STAGES, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name == "kvferry_router_stage_seconds":
            for sample in family.samples:
                stage = sample.labels.get("stage", "")
                if sample.name.endswith("_sum") and stage in out:
                    out[stage] = sample.value
    return out


def filler(rng: random.Random, chars: int) -> str:
    """`chars` characters of random letters, spaces, dots and newlines."""
    return "".join(rng.choice("abcdefghij klmnop qrstuv wxyz.\n") for _ in range(chars))


async def stream_text(r: aiohttp.ClientResponse) -> str:
    """The text of a streamed answer (its events' content, joined)."""
    out = []
    async for raw in r.content:
        line = raw.strip()
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:]).get("choices") or []:
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)

"""A fake engine for the router's failure tests: it answers like vLLM's P and D, records
every request it gets, and fails on command (an error status, a stream cut off or gone
silent, a request held until the router hangs up); plus the router settings that put
fakes or an unreachable P in front of a deployment."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from controlplane.daemon import Daemon
from kvferry.turnheaders import NOT_DELIVERED_HEADER
from kvferry.v1 import leases_pb2_grpc, nodes_pb2_grpc
from router import Settings as RouterSettings
from tests.conftest import serve_app
from tests.factories import lease_request, node_request
from tests.router.conftest import Stack, router_settings
from tests.router.helpers import COMPLETIONS


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


class FakeEngine:
    """Answers like vLLM P and D, records requests; `break_after` events cuts D's stream,
    `stall_after` events leaves it open and silent."""

    def __init__(self, break_after: int | None = None, stall_after: int | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.break_after = break_after
        self.stall_after = stall_after
        self.url = ""
        self.tokenize_fails = False
        self.model = "fake"
        self.models_status = 200
        self.models_auth: list[str] = []
        self.version = ""
        """What its GET /version reports ("" = no such route: 404)."""
        self.answers: list[int] = []
        """Statuses the next generation requests get, in turn (0: no answer until the peer
        hangs up, -1: a sidecar's "never delivered" 502); then the usual answers (a release,
        a streamed beam search, gets vLLM's 400: `kvferry.releases`)."""

    async def tokenize(self, request: web.Request) -> web.Response:
        self.requests.append(("/tokenize", _lower(request.headers), await request.json()))
        if self.tokenize_fails:
            return web.json_response({"error": "cannot"}, status=500)
        return web.json_response({"count": 40, "max_model_len": 4096, "tokens": list(range(40))})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, _lower(request.headers), body))
        status = self.answers.pop(0) if self.answers else 200
        beam_stream = body.get("stream") and body.get("use_beam_search")
        if status == 200 and request.path == COMPLETIONS and beam_stream:
            # vLLM's first check of a completion: a release is refused before admission
            message = "Streaming is not currently supported with beam search"
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        if status == 0:
            while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            return web.Response()
        if status == -1:  # what a sidecar answers for a request its engine never got
            error = {"message": "engine unreachable", "type": "BadGateway", "param": None, "code": 502}
            return web.json_response({"error": error}, status=502, headers={NOT_DELIVERED_HEADER: "1"})
        if status != 200:
            error = {"message": "refused", "type": "BadRequestError", "param": None, "code": status}
            return web.json_response({"error": error}, status=status)
        if not body.get("stream"):
            params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [[1]]}
            return web.json_response(
                {"id": "x", "object": "chat.completion", "choices": [], "kv_transfer_params": params}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            if self.break_after is not None and i == self.break_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == self.stall_after:  # silent until the router gives up and hangs up
                while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)  # (aiohttp sets no event when the peer hangs up)
                return resp
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def show_version(self, request: web.Request) -> web.Response:
        if not self.version:
            raise web.HTTPNotFound()
        return web.json_response({"version": self.version})

    async def models(self, request: web.Request) -> web.Response:
        self.models_auth.append(request.headers.get("Authorization", ""))
        if self.models_status != 200:
            return web.json_response({"error": "no"}, status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": self.model, "parent": None}]})


@contextlib.asynccontextmanager
async def fake_engine(
    break_after: int | None = None, stall_after: int | None = None
) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(break_after, stall_after)
    app = web.Application()
    app.router.add_post("/tokenize", fake.tokenize)
    app.router.add_post("/v1/chat/completions", fake.generate)
    app.router.add_post("/v1/completions", fake.generate)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/version", fake.show_version)
    async with serve_app(app) as fake.url:
        yield fake


def on_fakes(daemon: Daemon, p: FakeEngine, d: FakeEngine, **changes: Any) -> RouterSettings:
    """A router's settings with `p` and `d` as its nodes (given: not discovered)."""
    return router_settings(daemon, nodes__prefill_urls=(p.url,), nodes__decode_urls=(d.url,), **changes)


HI_C = {"messages": [{"role": "user", "content": "hi"}], "conversation_id": "c"}
"""A turn of conversation "c" (the one `fakes_with_a_lease` holds a retention for)."""


@contextlib.asynccontextmanager
async def fakes_with_a_lease(
    daemon: Daemon,
) -> AsyncIterator[tuple[FakeEngine, FakeEngine, leases_pb2_grpc.LeasesStub]]:
    """A fake P and D, and a retention of conversation "c" on node d-1 (no digests)."""
    async with fake_engine() as p, fake_engine() as d, grpc.aio.insecure_channel(daemon.address) as ch:
        leases = leases_pb2_grpc.LeasesStub(ch)
        await nodes_pb2_grpc.NodesStub(ch).Register(node_request("d-1"))
        await leases.Register(lease_request("c"))
        yield p, d, leases


def behind_first(stack: Stack, first_p: str) -> RouterSettings:
    """A router on the stack's daemon, its P and D as static nodes, with `first_p` listed
    (and so chosen) before the live P."""
    [p], [d] = stack.prefills, stack.decodes
    return router_settings(
        stack.daemon,
        nodes__prefill_urls=(first_p, stack.sidecar(p).url),
        nodes__decode_urls=(stack.sidecar(d).url,),
        nodes__model=p.config.model,
    )

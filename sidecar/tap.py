"""The HTTP tap: an aiohttp reverse proxy in front of the engine's serving paths.

Answers pass through chunk by chunk as they arrive (each chunk is written to
the client at once; nothing is buffered but an SSE event's unterminated tail).
A generation request naming a conversation is rewritten (see
``sidecar.capture.plan_request``) and its answer read on the way through; when
the engine finished it normally with D's ``kv_transfer_params``, the turn is
drafted into a retention and queued for registration — after the answer, and
never delaying it. A streamed turn D finished without saying which blocks it
keeps (vLLM without PR 40186) goes in the ledger of blocks no retention names
(``sidecar.unretained``). Anything the engine does with bad input is passed back
as the engine answered it. ``/kvferry/metrics`` is the sidecar's own.

Which paths are proxied, and to whom, is `sidecar.paths`' table, applied by the gate
(`sidecar.gate`); a body is read with `sidecar.bodies`' caps and deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import aiohttp
import structlog
from aiohttp import hdrs, web
from multidict import CIMultiDict

from kvferry.hops import never_delivered
from kvferry.releases import notifiable
from kvferry.security.policy import Policy
from kvferry.serving import guard_middleware
from kvferry.turnheaders import NO_RETENTION_HEADER, NOT_DELIVERED_HEADER
from sidecar.bodies import BodyBudget, BodyLimits, request_body
from sidecar.capture import RequestPlan, SseRewriter, TurnObserver, plan_request, rewrite_json
from sidecar.drafts import RetentionDraft, draft_retention
from sidecar.engine import DEFAULT_BLOCK_SIZE, EngineInstance
from sidecar.gate import ROUTE_KEY, TOKEN_USED_KEY, gate
from sidecar.metrics import SidecarMetrics
from sidecar.releases import Releaser
from sidecar.retentions import RetentionSender
from sidecar.settings import Settings
from sidecar.unretained import (
    STREAM_WITHOUT_PARAMS,
    UnretainedLedger,
    computed_tokens,
    outcome_of,
    pinned_blocks,
    warning_detail,
)

log = structlog.get_logger(__name__)

_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
    )
)
# (content-encoding: aiohttp decoded the body it read, which goes on as it is now;
# expect: aiohttp answered a 100-continue itself)
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect"}


def _connection_named(headers: Mapping[str, str]) -> set[str]:
    """Headers the Connection header names: hop-by-hop too (RFC 9110, 7.6.1)."""
    return {name.strip().lower() for name in headers.get("Connection", "").split(",")}


def request_headers(headers: Mapping[str, str], tapped: bool, token_used: bool = False) -> CIMultiDict[str]:
    """Client headers as the engine should get them (`token_used`: without Authorization,
    which named the caller to the tap)."""
    out: CIMultiDict[str] = CIMultiDict()
    named = _connection_named(headers)
    for name, value in headers.items():
        lower = name.lower()
        if lower in _NOT_FORWARDED or lower in named or (tapped and lower == "accept-encoding"):
            continue
        if token_used and lower == "authorization":
            continue
        out.add(name, value)
    if tapped:
        out["Accept-Encoding"] = "identity"  # the tap reads the answer
    return out


def response_headers(headers: Mapping[str, str], rewritten: bool) -> CIMultiDict[str]:
    """Engine headers as the client should get them."""
    out: CIMultiDict[str] = CIMultiDict()
    named = _connection_named(headers)
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in named or (rewritten and lower == "content-length"):
            continue
        out.add(name, value)
    return out


def _bad_gateway(message: str, delivered: bool) -> web.Response:
    body = {"error": {"message": message, "type": "BadGateway", "param": None, "code": 502}}
    return web.json_response(body, status=502, headers=None if delivered else {NOT_DELIVERED_HEADER: "1"})


class Tap:
    """The proxy's request handling."""

    def __init__(
        self,
        settings: Settings,
        http: aiohttp.ClientSession,
        instance: EngineInstance,
        retentions: RetentionSender,
        metrics: SidecarMetrics,
        unretained: UnretainedLedger,
        releaser: Releaser | None = None,
    ) -> None:
        self._s = settings
        self._releaser = releaser
        self._base = settings.engine.url
        self._http = http
        self._instance = instance
        self._retentions = retentions
        self._metrics = metrics
        self._unretained = unretained
        self._capture = settings.engine.role != "prefill"
        self._side_channel_host = settings.side_channel_host
        self._body_limits = BodyLimits(settings.tap.max_body_bytes, settings.tap.body_timeout_s)
        self.bodies = BodyBudget(settings.tap.max_bodies_bytes)
        """Request body bytes held by the requests in flight."""

    def app(self, policy: Policy | None = None) -> web.Application:
        """The tap's application, its callers checked against `policy` (None: development mode)."""
        middlewares = [guard_middleware, gate(policy, self._s.tap.tenant_header)]
        app = web.Application(client_max_size=self._s.tap.max_body_bytes, middlewares=middlewares)
        app.router.add_route("*", "/{tail:.*}", self._serve)
        return app

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        if request[ROUTE_KEY].local:
            return await self._serve_metrics(request)
        async with request_body(request, self._body_limits, self.bodies) as body:
            return await self.proxy(request, body)

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        payload, content_type = self._metrics.render()
        return web.Response(body=payload, headers={"Content-Type": content_type})

    async def proxy(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Pass `request` (its body read: `body`) to the engine, and its answer back."""
        capture = self._capture and NO_RETENTION_HEADER not in request.headers
        plan = plan_request(
            request.method, request.path, request.headers, body, self._s.tap.tenant_header, capture
        )
        tapped = plan is not None
        epoch = self._instance.epoch  # (the engine process the request goes to)
        self._metrics.proxied.labels("yes" if tapped else "no").inc()
        try:
            upstream = await self._http.request(
                request.method,
                self._base + request.raw_path,
                headers=request_headers(request.headers, tapped, request[TOKEN_USED_KEY]),
                data=(plan.body if plan else body) or None,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self._metrics.upstream_errors.labels("connect").inc()
            log.warning("tap.engine.unreachable", path=request.path, error=str(e) or type(e).__name__)
            return _bad_gateway(f"engine unreachable: {e}", delivered=not never_delivered(e))
        try:
            content_type = upstream.headers.get(hdrs.CONTENT_TYPE, "")
            if plan is None or not plan.capture or upstream.status != 200:
                if plan is not None and plan.capture:
                    self._metrics.turns.labels("engine_status").inc()
                return await self._pass(request, upstream)
            if content_type.startswith("text/event-stream"):
                return await self._stream(request, upstream, plan, epoch)
            if "json" in content_type:
                return await self._json(upstream, plan, epoch)
            self._metrics.turns.labels("not_json").inc()
            return await self._pass(request, upstream)
        finally:
            if upstream.content.at_eof():
                upstream.release()  # the connection goes back to the pool
            else:
                upstream.close()  # the engine sees the client leave and aborts the request

    async def _pass(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=response_headers(upstream.headers, False)
        )
        await resp.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as e:
            return self._broken(request, resp, e)
        await resp.write_eof()
        return resp

    def _broken(self, request: web.Request, resp: web.StreamResponse, e: BaseException) -> web.StreamResponse:
        """The engine failed mid-answer: cut the client's connection so it sees a truncated
        answer. (Or the client left: a write found its connection closed; no engine error.)"""
        if isinstance(e, ConnectionResetError):  # (aiohttp's ClientConnectionResetError is one)
            log.info("tap.client.left", path=request.path)
        else:
            self._metrics.upstream_errors.labels("mid_answer").inc()
            log.warning("tap.engine.failed_mid_answer", path=request.path, error=str(e) or type(e).__name__)
        request.protocol.force_close()
        return resp

    async def _json(self, upstream: aiohttp.ClientResponse, plan: RequestPlan, epoch: int) -> web.Response:
        observer = TurnObserver(strip_token_ids=plan.strip_token_ids)
        try:
            raw = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            self._metrics.upstream_errors.labels("mid_answer").inc()
            return _bad_gateway(f"engine failed: {e}", delivered=True)
        body = rewrite_json(raw, observer)
        self._conclude(observer, plan, epoch, streamed=False)
        return web.Response(
            body=body, status=upstream.status, headers=response_headers(upstream.headers, body is not raw)
        )

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, plan: RequestPlan, epoch: int
    ) -> web.StreamResponse:
        observer = TurnObserver(strip_token_ids=plan.strip_token_ids)
        sse = SseRewriter(observer)
        resp = web.StreamResponse(status=upstream.status, headers=response_headers(upstream.headers, True))
        try:
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    out = sse.feed(chunk)
                    if out:
                        await resp.write(out)
                rest = sse.flush()
                if rest:
                    await resp.write(rest)
            except (aiohttp.ClientError, TimeoutError) as e:
                return self._broken(request, resp, e)
            await resp.write_eof()
            return resp
        finally:
            # Also when the client left: if the engine finished the turn, D holds the blocks.
            self._conclude(observer, plan, epoch, streamed=True)

    def _conclude(self, observer: TurnObserver, plan: RequestPlan, epoch: int, streamed: bool) -> None:
        """Draft and queue the retention the answer describes (no I/O, never raises)."""
        try:
            turn = observer.finished()
            if isinstance(turn, str):
                turn = outcome_of(
                    turn, observer, streamed=streamed, with_prefill_params=plan.with_prefill_params
                )
                self._metrics.turns.labels(turn).inc()
                if turn == STREAM_WITHOUT_PARAMS:
                    self._uncaptured(observer, plan, epoch)
                return
            epoch = self._instance.observe_engine_id(turn.params.get("remote_engine_id"))
            draft = draft_retention(
                turn,
                tenant=plan.tenant,
                conversation_id=plan.conversation_id,
                model=plan.model,
                epoch=epoch,
                side_channel_host=self._side_channel_host,
                request_id=plan.request_id,
                now_mono=time.perf_counter(),
                now_wall=time.time(),
                blocks_ttl_s=self._s.engine.blocks_ttl_s,
            )
            if isinstance(draft, str):
                self._metrics.turns.labels(draft).inc()
                return
            if plan.ends:
                self._end(draft)
                return
            self._metrics.turns.labels("captured").inc()
            self._retentions.submit(draft)
        except Exception:  # a bug here must not cost the client its answer
            log.exception("tap.capture.failed", conversation_id=plan.conversation_id)

    def _end(self, draft: RetentionDraft) -> None:
        """The conversation's last turn: have D free the blocks now (through a prefill
        node), not retain them for a turn that will not come."""
        self._metrics.turns.labels("conversation_end").inc()
        facts = self._instance.facts
        if self._releaser is None or facts is None or not notifiable(draft.params):
            log.info("tap.conversation_end.unreleased", conversation_id=draft.conversation_id)
            return  # (D frees them at its TTL)
        self._metrics.releases.labels("conversation_end").inc()
        self._releaser.release(draft.params, facts.model, facts.block_size, draft.conversation_id)

    def _uncaptured(self, observer: TurnObserver, plan: RequestPlan, epoch: int) -> None:
        """A turn whose blocks D pinned without saying which: into the ledger, and the first
        of the engine process's told to the operator."""
        facts = self._instance.facts
        block_size = facts.block_size if facts else self._s.engine.block_size or DEFAULT_BLOCK_SIZE
        tokens = computed_tokens(observer)
        blocks = None if tokens is None else pinned_blocks(tokens, block_size)
        self._metrics.uncaptured_turns.inc()
        if self._unretained.add(epoch, blocks, observer.finished_at or time.monotonic()):
            log.warning(
                "tap.stream.uncaptured",
                detail=warning_detail(self._unretained.ttl_s),
                epoch=epoch,
                conversation_id=plan.conversation_id,
                blocks=blocks,
            )
        else:
            log.debug("tap.stream.uncaptured", conversation_id=plan.conversation_id, blocks=blocks)

"""Step 4 of a turn (`router.turn`): D, through its sidecar, and its answer relayed.

D gets P's params, the conversation and tenant headers (the sidecar registers D's
blocks for the next turn), or, for a turn nothing is retained of, a header saying so.
A D that cannot be reached is replaced by another of its block size. D's answer goes
to the client as it comes, scrubbed of what only the router's hops may see
(`router.relay`), with the turn's reuse in ``X-Kvferry-Reuse*`` headers; engine 4xx
answers reach the client as D gave them, 5xx and unreachable Ds become a 502. When D
refuses a turn, the blocks P kept for it are released through D (`router.releases`).
This is where a turn's time to first byte and its latency are measured.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import hdrs, web

from kvferry.turnheaders import CONVERSATION_HEADER, END_HEADER, NO_RETENTION_HEADER, TENANT_HEADER
from router.choice import Node, choose_decode
from router.decisions import Failure, FailureKind, decode_body, retry_decode_elsewhere
from router.errors import bad_gateway, engine_message, passthrough
from router.relay import SseScrubber, scrub_json
from router.releases import release_prefill
from router.trace import TurnTrace, wall_clock_of
from router.upstream import Reply, UpstreamError, encode

if TYPE_CHECKING:
    from router.turn import Turn

_PASSED_RESPONSE_HEADERS = (hdrs.CONTENT_TYPE, "X-Request-Id")


async def decode_and_relay(
    turn: Turn, node: Node, prefill_params: dict[str, Any] | None, retain: bool = True
) -> web.StreamResponse:
    """D's answer to the turn, relayed to the client (`prefill_params`: P's, None = D
    serves it alone; with `retain`, D's sidecar registers what D keeps of it)."""
    s = turn.s
    payload = encode(decode_body(turn.body, prefill_params, turn.forwarded_ids()))
    t0 = time.perf_counter()
    tried: set[str] = set()
    while True:
        tried.add(node.engine_id)
        with s.load.track(node):
            try:
                upstream = await s.engines.open(node.url + turn.path, payload, _decode_headers(turn, retain))
            except UpstreamError as e:
                s.metrics.upstream_error("decode", e.failure)
                turn.log.warning("router.decode.unreachable", node=node.engine_id, error=str(e))
                if e.failure.kind is FailureKind.CONNECT:
                    turn.mark_unreachable(node)
                # (another of its block size first: it was chosen for P's)
                other = choose_decode(
                    turn.nodes, s.load.view, exclude=tried, block_size=node.block_size, avoid=turn.down
                )
                if other is not None and retry_decode_elsewhere(e.failure, True):
                    node = other
                    continue
                return bad_gateway(engine_message(None, e.failure, "decode"))
            s.load.reached(node.engine_id)
            return await _answer(turn, node, upstream, t0, prefill_params)


def _decode_headers(turn: Turn, retain: bool) -> dict[str, str]:
    """With `retain`, D's sidecar is told the conversation (to capture what D retains)."""
    ident = turn.identity
    extra: list[tuple[str, str]] = []
    if ident.conversation_id and retain:
        extra.append((CONVERSATION_HEADER, ident.conversation_id))
        if ident.tenant:
            extra.append((TENANT_HEADER, ident.tenant))
        if turn.ends:  # (the client's last turn: D's sidecar frees what D keeps at once)
            extra.append((END_HEADER, "1"))
    elif not retain:  # (a body session_id would still name the conversation to the sidecar)
        extra.append((NO_RETENTION_HEADER, "1"))
    return turn.engine_headers(turn.request_id, extra)


async def _answer(
    turn: Turn,
    node: Node,
    upstream: aiohttp.ClientResponse,
    t0: float,
    prefill_params: Mapping[str, Any] | None,
) -> web.StreamResponse:
    turn.s.metrics.stage.labels("decode_start").observe(time.perf_counter() - t0)
    try:
        return await _relay(turn, node, upstream, prefill_params)
    finally:
        if upstream.content.at_eof():
            upstream.release()
        else:
            upstream.close()  # the client left or D broke off: D's sidecar sees it and aborts


async def _relay(
    turn: Turn, node: Node, upstream: aiohttp.ClientResponse, prefill_params: Mapping[str, Any] | None
) -> web.StreamResponse:
    if upstream.status != 200:
        if prefill_params:  # before reading D's answer: a client that leaves cancels that
            release_prefill(turn, node, prefill_params)
        try:
            reply = Reply(upstream.status, await upstream.read(), upstream.headers.get(hdrs.CONTENT_TYPE, ""))
        except (aiohttp.ClientError, TimeoutError):
            reply = Reply(upstream.status, b"", "")
        failure = Failure(FailureKind.STATUS, upstream.status)
        turn.s.metrics.upstream_error("decode", failure)
        turn.log.info("router.decode.refused", node=node.engine_id, status=upstream.status)
        if failure.client_error:
            return passthrough(reply)
        return bad_gateway(engine_message(reply, failure, "decode"))
    headers = _reuse_headers(turn)
    for name in _PASSED_RESPONSE_HEADERS:
        if name in upstream.headers and name not in headers:
            headers[name] = upstream.headers[name]
    if upstream.headers.get(hdrs.CONTENT_TYPE, "").startswith("text/event-stream"):
        return await _stream(turn, node, upstream, headers)
    try:
        raw = await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        turn.s.metrics.upstream_error("decode", Failure(FailureKind.PROTOCOL))
        return bad_gateway(f"decode engine failed mid-answer: {e}")
    if turn.usage is not None:
        turn.usage.feed(raw)
    _observe_first_bytes(turn)
    _observe_end(turn)
    return web.Response(body=scrub_json(raw), status=200, headers=headers)


def _reuse_headers(turn: Turn) -> dict[str, str]:
    r = turn.reuse
    if r is None:
        return {"X-Request-Id": turn.answer_id}
    return {
        "X-Request-Id": turn.answer_id,
        "X-Kvferry-Reuse": r.decision,
        "X-Kvferry-Reuse-Reason": r.reason,
        "X-Kvferry-Reused-Tokens": str(r.reusable_tokens if r.pull else 0),
    }


async def _stream(
    turn: Turn, node: Node, upstream: aiohttp.ClientResponse, headers: Mapping[str, str]
) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
    request = turn.request
    assert request is not None  # (the turn is being served)
    await resp.prepare(request)
    scrubber = SseScrubber()
    first = True
    try:
        async for chunk in upstream.content.iter_any():
            if turn.usage is not None:
                turn.usage.feed(chunk)
            out = scrubber.feed(chunk)
            if out:
                await resp.write(out)
                if first:
                    first = False
                    _observe_first_bytes(turn)
        rest = scrubber.flush()
        if rest:
            await resp.write(rest)
        await resp.write_eof()
    except ConnectionResetError:  # the client left (a write found its transport closed)
        return resp  # (D is aborted as the upstream closes)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as e:
        # D broke off mid-answer: cut the client's connection so it sees a truncated answer.
        turn.s.metrics.upstream_error("decode", Failure(FailureKind.PROTOCOL))
        turn.log.warning("router.decode.broke_off", node=node.engine_id, error=str(e) or type(e).__name__)
        if request.transport is not None:
            request.transport.close()
        return resp
    if scrubber.error is None:
        _observe_end(turn)
    else:  # relayed as D sent it; not a completed answer
        turn.s.metrics.upstream_error("decode", Failure(FailureKind.STATUS, scrubber.error))
        turn.log.warning("router.decode.stream_error", node=node.engine_id, status=scrubber.error)
    return resp


def _label(turn: Turn) -> str:
    return "pull" if turn.reuse is not None and turn.reuse.pull else "none"


def _observe_first_bytes(turn: Turn) -> None:
    turn.first_byte_s = time.perf_counter() - turn.started
    turn.s.metrics.ttft.labels(_label(turn)).observe(turn.first_byte_s)


def _observe_end(turn: Turn) -> None:
    elapsed = time.perf_counter() - turn.started
    turn.s.metrics.latency.labels(_label(turn)).observe(elapsed)
    turn.log.debug(
        "router.turn.complete",
        decision=turn.reuse.decision if turn.reuse else None,
        reason=turn.reuse.reason if turn.reuse else None,
        seconds=round(elapsed, 4),
    )
    if turn.s.trace is not None:
        record_turn(turn, turn.s.trace, elapsed)


def record_turn(turn: Turn, trace: TurnTrace, elapsed: float) -> None:
    """Append the finished turn to the router's trace (`router.trace`)."""
    usage, reuse = turn.usage, turn.reuse
    prompt = len(turn.tokens) if turn.tokens else (usage.prompt_tokens if usage else 0)
    output = usage.completion_tokens if usage and usage.completion_tokens else 0
    if not output:
        limit = turn.body.get("max_completion_tokens", turn.body.get("max_tokens"))
        output = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
    trace.record(
        started=wall_clock_of(turn.started),
        tenant=turn.identity.tenant,
        conversation=turn.identity.conversation_id,
        prompt_tokens=prompt,
        output_tokens=output,
        reused_tokens=reuse.reusable_tokens if reuse is not None and reuse.pull else 0,
        decision=reuse.decision if reuse is not None else "NONE",
        ttft_s=turn.first_byte_s,
        latency_s=elapsed,
        reason=reuse.reason if reuse is not None else "",
    )

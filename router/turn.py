"""One turn through P and D: the turn's story, and the state its steps share.

With the steps' modules, the small async layer that applies the decisions
(`router.choice`, `router.decisions`, `router.patience`: pure):

1. Choose P and D (`router.choice`).
2. Prepare (`router.prepare`): with a conversation id, tokenize once (``--tokenizer``'s
   files, `router.tokenizer`, else P's ``/tokenize``),
   digest the prompt, and ``Lookup`` under a short deadline; with several caching P,
   score them meanwhile.
3. Prefill (here): P gets the daemon's params (a pull, a release, or fresh ones),
   ``max_tokens: 1``, not streamed; P renders the prompt itself, as /tokenize did (the
   token ids go along only with ``--forward-prompt-token-ids``, on chat requests:
   `Turn.forwarded_ids`). A failure is retried once as `router.decisions.retry_after`
   says. Tokenize and prefill requests go to the engine itself when its sidecar
   advertised it (nothing on that path needs the tap).
4. Decode (`router.decode`): D, through its sidecar, and its answer relayed to the
   client as it comes.

Engine 4xx answers reach the client as the engine gave them; engine 5xx and
unreachable engines become a 502 JSON error. Blocks an engine kept for the turn that no
request will carry are released (`router.releases`). Nothing the daemon does (or fails
to do) changes what the client gets, only how fast.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from kvferry.digests import DigestCache
from kvferry.looplag import LoopLag
from kvferry.releases import nothing_to_pull
from kvferry.turnheaders import conversation_ends
from router.choice import (
    Node,
    alike,
    cached_under_plain_hashes,
    choose_decode,
    choose_prefill,
    fresh_retry_node,
    prefill_candidates,
    serving,
    worth_scoring,
)
from router.daemon_client import DaemonClient
from router.decisions import (
    Failure,
    FailureKind,
    Retry,
    Reuse,
    Skip,
    decode_alone_reason,
    plain_reason,
    prefill_body,
    prefill_kv_params,
    retry_after,
    skipped,
    spends_retry,
)
from router.decode import decode_and_relay
from router.errors import bad_gateway, engine_message, error_response, passthrough
from router.identity import Identity, identify
from router.metrics import RouterMetrics
from router.nodes import DirectRoutes, Load, NodeDirectory
from router.patience import PrefillRates
from router.prepare import prepare
from router.releases import Releases, release_claim
from router.settings import Settings
from router.tokenizer import LocalTokenizer, TokenizerChecks
from router.trace import TurnTrace, UsageSniffer
from router.upstream import Engines, Reply, UpstreamError, client_request_id, encode

log = structlog.get_logger(__name__)

_NextTry = tuple[Node, dict[str, Any] | None, int]
"""Where a failed prefill is retried: the node, D's params it carries, the attempts spent."""


@dataclass
class Shared:
    """What every turn of one router uses."""

    settings: Settings
    engines: Engines
    directory: NodeDirectory
    load: Load
    daemon: DaemonClient | None
    metrics: RouterMetrics
    tickets: itertools.count[int]
    direct: DirectRoutes
    digests: DigestCache
    rates: PrefillRates
    """Prefill seconds per token, as measured: how long lookups are waited for."""
    releases: Releases
    """Releases of blocks kept for turns, still on their way (`router.releases`)."""
    lag: LoopLag = field(default_factory=LoopLag)
    """How late the router's loop runs (its task: `Router.start`): lookups wait for it too."""
    trace: TurnTrace | None = None
    """Where finished turns are recorded (``--trace-out``; None: nowhere)."""
    tokenizer: LocalTokenizer | None = None
    """The model's tokenizer files (``--tokenizer``; None: P's /tokenize tokenizes)."""
    tokenizer_checks: TokenizerChecks = field(default_factory=TokenizerChecks)
    """Which nodes' /tokenize gave the local tokenizer's ids (`router.tokenizer`)."""


class Turn:
    """One client request to /v1/chat/completions or /v1/completions: its state, which
    the steps (`router.prepare`, `router.decode`, `router.releases`) read and fill in."""

    def __init__(
        self, shared: Shared, request: web.Request, path: str, body: dict[str, Any], tenant: str
    ) -> None:
        self.s = shared
        self.request: web.Request | None = request
        """Until the turn ends (see `serve`)."""
        self._client_headers = request.headers
        self.ends = conversation_ends(request.headers)
        """The client said this is its conversation's last turn (nothing is retained)."""
        self.path = path
        self.body = body
        self.started = time.perf_counter()
        self.nodes = serving(shared.directory.nodes, body.get("model"))
        """The nodes this turn may use: those serving the requested model."""
        self.request_id = f"kvf-{uuid.uuid4().hex}"
        """The router's id of the turn: the daemon's and D's sidecar's, and the logs'."""
        self.answer_id = client_request_id(request.headers, body) or self.request_id
        """The id the engines name the answer after, echoed in X-Request-Id: the client's own
        (its X-Request-Id, else its body's request_id), as vLLM takes it, else the turn's."""
        self.identity: Identity = identify(request.headers, body, tenant)
        """Its tenant (`tenant`: as the client's API key names it) and conversation."""
        self.tokens: Sequence[int] | None = None
        """The prompt's token ids: an engine's (a list), or the router's own (an array)."""
        self.tokenized_locally = False
        """`tokens` are the router's own tokenizer's (`router.tokenizer`), not an engine's."""
        self.tokenized_by: Node | None = None
        """The P that tokenized instead of the chosen one (unreachable): the prefill goes there."""
        self.unreachable: set[str] = set()
        """Nodes this turn could not connect to (no retry or release goes there)."""
        self.down = shared.load.down(time.monotonic())
        """Nodes the router could not connect to lately: a choice leaves them out while any
        other will do (a preference: a retry may still go there)."""
        self.reuse: Reuse | None = None
        self.first_byte_s: float | None = None
        """Seconds from the turn's start to the first bytes of its answer (once they went)."""
        self.usage: UsageSniffer | None = UsageSniffer() if shared.trace is not None else None
        """The answer's token counts as they pass (only when turns are traced)."""
        self.log = log.bind(
            request_id=self.request_id,
            client_request_id=None if self.answer_id == self.request_id else self.answer_id,
            conversation_id=self.identity.conversation_id or None,
        )

    # -- the turn ---------------------------------------------------------------------

    async def serve(self) -> web.StreamResponse:
        """Serve the turn: P then D (or D alone), and D's answer relayed; -> the client's answer."""
        try:
            return await self._serve()
        finally:
            # A lookup answered late (up to `late_answer_s`, minutes) still has this turn
            # release its claim: it keeps what that needs, not the request and its prompt.
            self.request, self.tokens = None, None
            self.body = {"model": self.body.get("model")}

    async def _serve(self) -> web.StreamResponse:
        """Choose P and D; prepare (tokenize, look up, score), prefill, decode."""
        nodes = self.nodes
        load = self.s.load.view
        tiebreak = next(self.s.tickets)
        conversation = self.identity.conversation_id
        alone = decode_alone_reason(self.body)
        if alone is not None:
            return await self._decode_alone(tiebreak, alone)
        prefill = choose_prefill(nodes, load, avoid=self.down, tiebreak=tiebreak)
        if prefill is not None:
            # One model per turn: a model name no node reports (an adapter's) leaves every
            # node a candidate, and P's KV is only any use to a D of P's base model.
            self.nodes = nodes = serving(nodes, prefill.model)
        size = prefill.block_size if prefill else 0
        decode = choose_decode(nodes, load, tiebreak, block_size=size, avoid=self.down)
        if prefill is None or decode is None:
            return error_response(503, "no prefill or no decode node available", "ServiceUnavailableError")
        plain = plain_reason(self.body)
        if plain is not None:
            return await self._serve_plain(prefill, decode, plain)
        scoring = (
            self.s.daemon is not None and worth_scoring(nodes) and cached_under_plain_hashes(self.body, nodes)
        )
        # D is counted from its choice (`decode_and_relay` counts it from then on): turns
        # arriving during this one's tokenizing, lookup and prefill see it taken, not idle.
        with self.s.load.track(decode):
            if conversation or scoring:
                prefill = await prepare(self, prefill, scoring, tiebreak)
            params = await self._prefill(prefill)
        if isinstance(params, web.Response):
            return params
        return await decode_and_relay(self, decode, params)

    async def _serve_plain(self, prefill: Node, decode: Node, why: Skip) -> web.StreamResponse:
        """A prompt with images (audio, ...; see `text_only`), or one the router cannot
        render as the engines would (see `reproducible`): plain P/D, nothing looked up,
        scored or retained. P and D get the request as the client sent it, no token ids."""
        self._skip(why)
        with self.s.load.track(decode):  # (counted from its choice, as in `serve`)
            params = await self._prefill(prefill)
        if isinstance(params, web.Response):
            return params
        return await decode_and_relay(self, decode, params, retain=False)

    async def _decode_alone(self, tiebreak: int, why: Skip) -> web.StreamResponse:
        """A request for several sequences, or a prompt given as embeddings: D serves it
        without P's params (see `single_sequence`), and nothing of it is retained."""
        decode = choose_decode(self.nodes, self.s.load.view, tiebreak, avoid=self.down)
        if decode is None:
            return error_response(503, "no decode node available", "ServiceUnavailableError")
        self._skip(why)
        return await decode_and_relay(self, decode, None, retain=False)

    def _skip(self, reason: Skip) -> None:
        """A turn naming a conversation served without a lookup: counted, and told the client."""
        if self.identity.conversation_id and self.s.settings.reuse.enabled:
            self.reuse = skipped(reason)
            self.s.metrics.lookup(self.reuse)

    # -- the prefill ------------------------------------------------------------------

    async def _prefill(self, node: Node) -> dict[str, Any] | web.Response | None:
        """P's kv_transfer_params for D (None: P gave none), or the client's error answer."""
        remote = self.reuse.remote if self.reuse is not None else None
        tried = set(self.unreachable)  # (a P the turn could not reach is no retry either)
        attempt = 0
        while True:
            tried.add(node.engine_id)
            kv = prefill_kv_params(self.reuse if remote else None, self.forwarded_ids())
            payload = encode(prefill_body(self.body, kv))
            reply: Reply | None = None
            t0 = time.perf_counter()
            with self.s.load.track(node):
                try:
                    reply = await self.post_to_prefill(node, self.path, payload)
                except UpstreamError as e:
                    failure = e.failure
                    self.log.info("router.prefill.unreachable", node=node.engine_id, error=str(e))
                except asyncio.CancelledError:
                    # The client left (or the router stops) while P had D's params: P's
                    # request is aborted, and an aborted read tells D nothing (a finished
                    # one already did: D then ignores this).
                    release_claim(self, node, remote)
                    raise
            if reply is not None:
                answer = reply.json() if reply.status == 200 else None
                if isinstance(answer, dict):
                    elapsed = time.perf_counter() - t0
                    self.s.metrics.stage.labels("prefill").observe(elapsed)
                    if self.tokens and not (remote and self.reuse is not None and self.reuse.pull):
                        self.s.rates.observe(node.model, len(self.tokens), elapsed)  # (P computed all)
                    params = answer.get("kv_transfer_params")
                    return params if isinstance(params, dict) else None
                kind = FailureKind.STATUS if reply.status != 200 else FailureKind.PROTOCOL
                failure = Failure(kind, reply.status)
            retried = self._prefill_failed(node, failure, reply, remote, tried, attempt)
            if isinstance(retried, web.Response):
                return retried
            node, remote, attempt = retried

    def _prefill_failed(
        self,
        node: Node,
        failure: Failure,
        reply: Reply | None,
        remote: dict[str, Any] | None,
        tried: set[str],
        attempt: int,
    ) -> web.Response | _NextTry:
        """The prefill on `node` (carrying D's params `remote`, at `attempt`) failed: ->
        the client's error answer, or where the retry goes (`router.decisions.retry_after`)."""
        self.s.metrics.upstream_error("prefill", failure)
        like = alike(self.nodes, node)  # (D's params are for a P of this one's block size)
        if remote and failure.kind is not FailureKind.CONNECT:
            # The request reached P with D's params, and no retry carries them: D would
            # hold the claimed blocks to its TTL. A 4xx is mostly P's frontend refusing
            # the request before its connector saw them (a prompt grown past
            # max_model_len, say); a failed pull (a 5xx) sends D no notification; a P
            # gone silent (a timeout) may never. (One that failed after its pull, whose
            # read notified D, has D ignore the second notification.)
            release_claim(self, node, remote)
        spare = prefill_candidates(like if remote else self.nodes, exclude=tried)
        retry = retry_after(failure, bool(remote), attempt, bool(spare))
        self.log.info(
            "router.prefill.failed",
            node=node.engine_id,
            kind=failure.kind.value,
            status=failure.status,
            with_params=bool(remote),
            retry=retry.value if retry else None,
        )
        if retry is None:
            if failure.client_error and reply is not None:
                return passthrough(reply)
            return bad_gateway(engine_message(reply, failure, "prefill"))
        self.s.metrics.prefill_retries.labels(retry.value).inc()
        if spends_retry(retry, bool(remote)):
            attempt += 1
        if retry is Retry.FRESH:
            unseen = failure.kind is FailureKind.CONNECT
            fresh = fresh_retry_node(node, self.nodes, tried, self.s.load.view, unseen)
            # Params P never got (it could not be reached) still go, with nothing to pull,
            # to a P that can take them: P then has D free the blocks claimed for this turn.
            take = unseen and fresh in like
            remote = nothing_to_pull(remote) if remote and take else None
            self.reuse = Reuse("RECOMPUTE", "prefill_failed", remote)
            node = fresh
        if retry is Retry.OTHER_NODE:
            node = choose_prefill(spare, self.s.load.view) or node
        return node, remote, attempt

    # -- what the steps share -----------------------------------------------------------

    def forwarded_ids(self) -> list[int] | None:
        """The prompt's token ids for P's and D's kv_transfer_params: only when the engines
        take them (``--forward-prompt-token-ids``: vLLM >= 0.32 reads them on its chat path
        alone), else None and each engine renders the request itself. Never the router's own
        tokenizer's: only a node's first turns are checked against its /tokenize, and
        forwarded ids are the engines' prompt (a wrong one would change the answer, where
        wrong digests only cost the reuse)."""
        forward = self.s.settings.upstream.forward_prompt_token_ids and not self.tokenized_locally
        if not forward or self.tokens is None or not self.path.endswith("/chat/completions"):
            return None
        tokens = self.tokens  # (an engine's: a list, as JSON takes it; never copied on this path)
        return tokens if isinstance(tokens, list) else list(tokens)

    def engine_headers(self, turn_id: str, extra: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
        """The headers of a request to an engine for this turn (`turn_id`: the turn's id on it,
        `extra`: headers of the hop's own)."""
        return self.s.engines.headers(self._client_headers, turn_id, extra, self.answer_id)

    async def post_to_prefill(
        self, node: Node, path: str, body: bytes, timeout_s: float | None = None, request_id: str = ""
    ) -> Reply:
        """POST to the engine itself when its sidecar advertised it, else (or when that
        cannot be connected to: the engine never saw the request) through the sidecar.
        `request_id`: the turn's id on the request (default: the turn's own)."""
        headers = self.engine_headers(request_id or self.request_id)
        url = self.s.direct.url(node)
        try:
            try:
                reply = await self.s.engines.post(url + path, body, headers, timeout_s)
            except UpstreamError as e:
                if e.failure.kind is not FailureKind.CONNECT or not self.s.direct.unreachable(node, url):
                    raise
                reply = await self.s.engines.post(node.url + path, body, headers, timeout_s)
        except UpstreamError as e:
            if e.failure.kind is FailureKind.CONNECT:  # no prefill, retry or release goes there
                self.mark_unreachable(node)
            raise
        self.s.load.reached(node.engine_id)
        return reply

    def mark_unreachable(self, node: Node) -> None:
        """`node` could not be connected to: this turn leaves it out, and the next ones for a
        while when they can."""
        self.unreachable.add(node.engine_id)
        self.down.add(node.engine_id)
        self.s.load.unreachable(node.engine_id, time.monotonic())

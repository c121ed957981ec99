"""Step 2 of a turn (`router.turn`): what the prefill must know before it leaves.

With a conversation id: the prompt's token ids (P's ``/tokenize``, or a twin's when P
cannot be connected to), their block digests (``kvferry.digests``, the sidecar's
function, through the router's digest cache), and the daemon's ``Lookup``, sent before
the prompt is known (`router.daemon_client`) and waited for as long as `router.patience`
says for the prompt's size. With several caching P, a ``Score`` meanwhile finds the P
holding most of the prompt. The outcome is the turn's `Reuse` (`Turn.reuse`) and the P
to prefill on.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

from kvferry.blockhash import block_hashes, external_block_hash
from kvferry.digests import DIGEST_SIZE, seed_for
from router.choice import Node, alike, choose_prefill
from router.decisions import Failure, FailureKind, Reuse, Skip, skipped
from router.patience import Patience, lookup_wait_s
from router.releases import release_claim
from router.upstream import UpstreamError, encode, tokenize_request, tokens_of

if TYPE_CHECKING:
    from router.turn import Turn

Made = tuple[list[int], bytes]
"""A prompt's token ids and their block digests."""


async def prepare(turn: Turn, prefill: Node, scoring: bool, tiebreak: int) -> Node:
    """Tokenize and look up (and score); -> the prefill node to use.

    The lookup leaves first: the daemon claims the conversation's retention while
    P tokenizes and the router digests, and decides once the prompt follows.
    """
    s = turn.s
    conversation = turn.identity.conversation_id
    if conversation and not s.settings.reuse.enabled:
        turn.reuse = skipped(Skip.REUSE_OFF)
    elif conversation and s.daemon is None:
        turn.reuse = skipped(Skip.NO_DAEMON)
    lookup: asyncio.Task[Reuse] | None = None
    if conversation and turn.reuse is None:
        assert s.daemon is not None
        prompt = asyncio.ensure_future(_prompt(turn, prefill))
        lookup = asyncio.ensure_future(
            s.daemon.lookup_early(
                turn.identity.tenant,
                conversation,
                prompt,
                answered_late=lambda reuse: release_claim(turn, prefill, reuse.remote),
                request_id=turn.request_id,
                wait_s=functools.partial(_lookup_wait_s, turn, prefill, scoring),
            )
        )
        made = await prompt
        turn.tokens = made[0] if made is not None else None
    elif scoring:
        turn.tokens = await _tokenize(turn, prefill)
    prefill = turn.tokenized_by or prefill
    if prefill.engine_id in turn.unreachable:  # (tokenizing could not reach it, nor a twin)
        others = choose_prefill(turn.nodes, s.load.view, exclude=turn.unreachable, tiebreak=tiebreak)
        prefill = others or prefill
    t0 = time.perf_counter()
    score = _score(turn, prefill) if scoring and turn.tokens is not None else None
    try:
        reuse, cached = await asyncio.gather(_maybe(lookup), _maybe(score))
    except asyncio.CancelledError:
        # The client left while the score was still out: a lookup answered by then has
        # claimed what no P request will carry (one still out answers its late hook).
        if lookup is not None and lookup.done() and not lookup.cancelled() and not lookup.exception():
            release_claim(turn, prefill, lookup.result().remote)
        raise
    if lookup is not None:
        s.metrics.stage.labels("lookup").observe(time.perf_counter() - t0)
        turn.reuse = reuse
        if turn.tokens is None and reuse.decision == "RECOMPUTE":
            # The daemon claimed before tokenizing failed: its release params still go to P.
            turn.reuse = Reuse("SKIPPED", Skip.NO_TOKENS.value, reuse.remote)
    if cached:
        like = alike(turn.nodes, prefill) if turn.tokens is not None else turn.nodes
        # (a P that could not be connected to for tokenizing is no choice for the prefill either)
        chosen = choose_prefill(like, s.load.view, cached, exclude=turn.unreachable, tiebreak=tiebreak)
        prefill = chosen or prefill
    if turn.reuse is not None:
        s.metrics.lookup(turn.reuse)
    return prefill


def _lookup_wait_s(turn: Turn, prefill: Node, scoring: bool, prompt_tokens: int) -> float:
    d = turn.s.settings.daemon
    patience = Patience(d.lookup_deadline_s, d.lookup_recompute_share, d.lookup_max_wait_s)
    rate = turn.s.rates.s_per_token(prefill.model)
    busy_s = d.score_deadline_s if scoring else 0.0
    return lookup_wait_s(patience, prompt_tokens, rate, busy_s, turn.s.lag.recent_s())


async def _prompt(turn: Turn, prefill: Node) -> Made | None:
    """The prompt's token ids (P's /tokenize) and their digests (None: P could not
    tokenize it)."""
    tokens = await _tokenize(turn, prefill)
    if tokens is None:
        return None
    requested = turn.body.get("model")
    chain = seed_for(prefill.model, requested if isinstance(requested, str) else "")
    cache, metrics = turn.s.digests, turn.s.metrics
    key = (turn.identity.tenant, turn.identity.conversation_id)
    t0 = time.perf_counter()
    try:
        digests, reused = cache.digests(key, tokens, prefill.block_size, chain)
    except ValueError as e:  # ids no engine would send: serve without reuse
        turn.log.warning("router.digests.failed", node=prefill.engine_id, error=str(e))
        return None
    metrics.stage.labels("digests").observe(time.perf_counter() - t0)
    metrics.digest_blocks.labels("reused").inc(reused)
    metrics.digest_blocks.labels("hashed").inc(len(digests) // DIGEST_SIZE - reused)
    metrics.digest_cache_bytes.set(cache.size_bytes)
    return tokens, digests


async def _tokenize(turn: Turn, node: Node) -> list[int] | None:
    req = tokenize_request(turn.path, turn.body)
    if req is None or isinstance(req, list):
        return req
    s = turn.s
    t0 = time.perf_counter()
    timeout_s = s.settings.upstream.tokenize_timeout_s
    raw = encode(req)
    asked = node
    try:
        try:
            reply = await turn.post_to_prefill(node, "/tokenize", raw, timeout_s)
        except UpstreamError as e:
            # P never saw it: another P of the same model and block size tokenizes (and
            # digests) the same, so the turn keeps its reuse, and prefills there too.
            if e.failure.kind is not FailureKind.CONNECT:
                raise
            twin = choose_prefill(alike(turn.nodes, node), s.load.view, exclude={node.engine_id})
            if twin is None:
                raise
            s.metrics.upstream_error("tokenize", e.failure)
            turn.log.info("router.tokenize.elsewhere", node=node.engine_id, other=twin.engine_id)
            asked = twin
            reply = await turn.post_to_prefill(twin, "/tokenize", raw, timeout_s)
            turn.tokenized_by = twin
    except UpstreamError as e:
        s.metrics.upstream_error("tokenize", e.failure)
        turn.log.info("router.tokenize.failed", node=asked.engine_id, error=str(e))
        return None
    s.metrics.stage.labels("tokenize").observe(time.perf_counter() - t0)
    tokens = tokens_of(reply.body) if reply.status == 200 else None
    if tokens is None:
        s.metrics.upstream_error("tokenize", Failure(FailureKind.STATUS, reply.status))
        turn.log.info("router.tokenize.refused", node=asked.engine_id, status=reply.status)
    return tokens


async def _score(turn: Turn, prefill: Node) -> dict[str, int]:
    assert turn.s.daemon is not None and turn.tokens is not None
    hashes = [external_block_hash(h) for h in block_hashes(turn.tokens, prefill.block_size)]
    return await turn.s.daemon.score(hashes) if hashes else {}


async def _maybe(aw: Any) -> Any:
    return None if aw is None else await aw

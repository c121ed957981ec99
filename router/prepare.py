"""Step 2 of a turn (`router.turn`): what the prefill must know before it leaves.

With a conversation id: the prompt's token ids (the router's own tokenizer files,
`router.tokenizer`, when given and checked against P's; else P's ``/tokenize``, or a
twin's when P cannot be connected to), their block digests (``kvferry.digests``, the sidecar's
function, through the router's digest cache), and the daemon's ``Lookup``, sent before
the prompt is known (`router.daemon_client`) and waited for as long as `router.patience`
says for the prompt's size. With several caching P, a ``Score`` meanwhile finds the P
holding most of the prompt. The outcome is the turn's `Reuse` (`Turn.reuse`) and the P
to prefill on.
"""

from __future__ import annotations

import array
import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvferry.blockhash import block_hashes, external_block_hash
from kvferry.digests import DIGEST_SIZE, seed_for
from router.choice import Node, alike, choose_prefill
from router.decisions import Failure, FailureKind, Reuse, Skip, skipped
from router.patience import Patience, lookup_wait_s
from router.releases import release_claim
from router.tokenizer import Check, LocalTokenizer, Pieces
from router.upstream import UpstreamError, encode, tokenize_request, tokens_of

if TYPE_CHECKING:
    from router.turn import Turn

_T = TypeVar("_T")
Made = tuple[Sequence[int], bytes]
"""A prompt's token ids (the local tokenizer's: an array, `LocalTokenizer.finish`) and
their block digests."""


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
        made = await _prompt_or_abandon(prompt, lookup, turn, prefill)
        turn.tokens = made[0] if made is not None else None
    elif scoring:
        turn.tokens = await _tokens(turn, prefill)
    prefill = turn.tokenized_by or prefill
    if prefill.engine_id in turn.unreachable:  # (tokenizing could not reach it, nor a twin)
        others = choose_prefill(turn.nodes, s.load.view, exclude=turn.unreachable, tiebreak=tiebreak)
        prefill = others or prefill
    t0 = time.perf_counter()
    score = _score(turn, prefill) if scoring and turn.tokens is not None else None
    try:
        # (no gather without a score: its tasks cost a turn of a busy loop or two)
        pair = (await _maybe(lookup), None) if score is None else await asyncio.gather(_maybe(lookup), score)
        reuse, cached = pair
    except asyncio.CancelledError:
        # The client left while the score was still out: a lookup answered by then has
        # claimed what no P request will carry.
        if lookup is not None:
            _abandon(lookup, turn, prefill)
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


async def _prompt_or_abandon(
    prompt: asyncio.Future[Made | None], lookup: asyncio.Future[Reuse], turn: Turn, prefill: Node
) -> Made | None:
    """The prompt; when the client leaves meanwhile (or making it breaks), the lookup
    out for it is abandoned (`_abandon`)."""
    try:
        return await prompt
    except BaseException:
        _abandon(lookup, turn, prefill)
        raise


def _abandon(lookup: asyncio.Future[Reuse], turn: Turn, prefill: Node) -> None:
    """No P request will carry what `lookup` claims: an answer already in is released now;
    one still out is cancelled, and its answer goes to the late hook, which releases it
    (cancelling the prompt alone leaves it be when the prompt had already come)."""
    if not lookup.done():
        lookup.cancel()
    elif not lookup.cancelled() and lookup.exception() is None:
        release_claim(turn, prefill, lookup.result().remote)


def _lookup_wait_s(turn: Turn, prefill: Node, scoring: bool, prompt_tokens: int) -> float:
    d = turn.s.settings.daemon
    patience = Patience(d.lookup_deadline_s, d.lookup_recompute_share, d.lookup_max_wait_s)
    rate = turn.s.rates.s_per_token(prefill.model)
    busy_s = d.score_deadline_s if scoring else 0.0
    return lookup_wait_s(patience, prompt_tokens, rate, busy_s, turn.s.lag.recent_s())


async def _prompt(turn: Turn, prefill: Node) -> Made | None:
    """The prompt's token ids (`_tokens`) and their digests (None: none could be made)."""
    if turn.s.tokenizer is not None:
        await _let_the_lookup_leave()
    tokens = await _tokens(turn, prefill)
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


async def _let_the_lookup_leave() -> None:
    """Two turns of the loop before the prompt's CPU work: in the first the lookup's task
    (started after this one) queues it on the stream, in the second the stream's writer
    hands it to gRPC. A local tokenizer waits on nothing: without these, the claim would
    leave only once the prompt is tokenized and digested, and the two would not overlap."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


_THREAD_CHARS = 16384
"""Text above which the local tokenizer runs in a thread: the lookup's I/O goes on meanwhile."""


async def _tokens(turn: Turn, node: Node) -> Sequence[int] | None:
    """The prompt's token ids: the local tokenizer's (``--tokenizer``) when it renders the
    request as the engine does and `node`'s /tokenize gave the same ids when compared
    (`router.tokenizer`), else `node`'s /tokenize's."""
    s = turn.s
    local = s.tokenizer
    req = tokenize_request(turn.path, turn.body) if local is not None else None
    if local is None or not isinstance(req, dict):
        return await _tokenize(turn, node)
    kind = "chat" if turn.path.endswith("/chat/completions") else "completion"
    check = s.tokenizer_checks.check(node.engine_id, kind, time.monotonic())
    t0 = time.perf_counter()
    pieces = _guarded(turn, local.pieces, turn.path, turn.body) if check is not Check.ENGINE else "node"
    if not isinstance(pieces, Pieces):
        turn.log.debug("router.tokenize.by_engine", node=node.engine_id, reason=pieces or "failed")
        s.metrics.tokenized.labels("engine").inc()
        return await _tokenize(turn, node)
    if check is Check.COMPARE:
        return await _compare(turn, node, kind, local, pieces)
    tokens = await _tokenize_locally(turn, local, pieces)
    if tokens is None:
        s.metrics.tokenized.labels("engine").inc()
        return await _tokenize(turn, node)
    s.metrics.stage.labels("tokenize").observe(time.perf_counter() - t0)
    s.metrics.tokenized.labels("local").inc()
    turn.tokenized_locally = True
    return tokens


def _guarded(turn: Turn, work: Callable[..., _T], *args: Any) -> _T | None:
    """`work(*args)`, or None when the tokenizer library or the template failed on an input
    no check foresaw: logged, and the engine tokenizes (a turn never fails for it)."""
    try:
        return work(*args)
    except Exception as e:
        turn.log.warning("router.tokenizer.failed", error=repr(e))
        return None


async def _tokenize_locally(turn: Turn, local: LocalTokenizer, pieces: Pieces) -> array.array[int] | None:
    if pieces.missing_chars <= _THREAD_CHARS:
        return _guarded(turn, local.finish, pieces)
    missing = await asyncio.to_thread(_guarded, turn, local.tokenize_missing, pieces)
    return None if missing is None else _guarded(turn, local.finish, pieces, missing)


async def _compare(
    turn: Turn, node: Node, kind: str, local: LocalTokenizer, pieces: Pieces
) -> list[int] | None:
    """A node's check: the turn tokenized both ways at once, the engine's ids kept, and the
    conversation's next turn too (a template whose rendering of the history changes as
    the conversation grows would pass the first and fail the second); the local tokenizer
    is used for the node's next turns only if both agreed."""
    s = turn.s
    mine, theirs, later = await asyncio.gather(
        _tokenize_locally(turn, local, pieces), _tokenize(turn, node), _next_turn_ids(turn, node, local)
    )
    if theirs is None or mine is None or later is None:
        return theirs  # (nothing compared: one side did not tokenize it)
    asked = turn.tokenized_by or node
    turn_agreed = list(mine) == theirs  # (an array never equals a list)
    agreed = turn_agreed and later[0] == later[1]
    s.tokenizer_checks.record(asked.engine_id, kind, agreed, time.monotonic())
    s.metrics.tokenized.labels("compared" if agreed else "differed").inc()
    if not agreed:
        a, b = later if turn_agreed else (mine, theirs)
        turn.log.warning(
            "router.tokenizer.differs",
            node=asked.engine_id,
            kind=kind,
            on="next_turn" if turn_agreed else "turn",
            files=local.fingerprint,
            local_tokens=len(a),
            engine_tokens=len(b),
            first_difference=_first_difference(a, b),
        )
    return theirs


async def _next_turn_ids(turn: Turn, node: Node, local: LocalTokenizer) -> tuple[list[int], list[int]] | None:
    """A chat's next turn (the messages, an answer and a question), tokenized locally and by
    `node` -> (local, engine) ids; ([], []) for a completion (no template); None when either
    could not tokenize it."""
    messages = turn.body.get("messages")
    if not isinstance(messages, list):
        return [], []
    follow = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    body = {**turn.body, "messages": follow}
    pieces = _guarded(turn, local.pieces, turn.path, body)
    req = tokenize_request(turn.path, body)
    if not isinstance(pieces, Pieces) or not isinstance(req, dict):
        return None
    mine = await _tokenize_locally(turn, local, pieces)
    try:
        reply = await turn.post_to_prefill(
            node, "/tokenize", encode(req), turn.s.settings.upstream.tokenize_timeout_s
        )
    except UpstreamError:
        return None
    theirs = tokens_of(reply.body) if reply.status == 200 else None
    return None if mine is None or theirs is None else (list(mine), theirs)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The index of the first id two token lists differ at (the shorter's length: a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


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

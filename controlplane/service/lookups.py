"""Lookups: validate the query, claim the conversation's retention, decide on the prompt.

The claim and everything that puts a claim back live in claims.py; the decision is
policy.decide on this replica's view of D's node (nodecache.py); this module sequences
them, and answers store_unavailable when etcd fails on the way. A lookup sent with
caller_verifies is decided on everything but the prompt, and its PULL hands D's sequence
back (`LookupResult.check`) for the caller to verify its prompt against, by the same rule
(kvferry.verification): the router's answer then waits on no prompt.

The usual turn awaits nothing at all: its shard's owner is this replica, with the
conversation in memory, and its node was read for lookups less than CONFIRM_S ago.
`lookup_now` decides it first and claims only then, so that Leases/Stream's reader answers
it with no task; anything else (a read to make, a put-back, a deadline to note) finds
nothing claimed and goes the awaited way (`lookup`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import structlog

from controlplane import metrics
from controlplane.errors import InvalidArgument, StoreUnavailable
from controlplane.owners import OwnedRetentions
from controlplane.policy import Decision, Policy, Prompt, Reason, decide, decide_claimed
from controlplane.records import Claim, Retention
from controlplane.service.budgets import Budgets
from controlplane.service.claims import Claimed, Claims
from controlplane.service.nodecache import NodeCache
from controlplane.service.validation import check_id, check_prompt, tenant_of
from controlplane.settings import Settings
from kvferry.verification import Held

log = structlog.get_logger(__name__)

#: How long a Lookup sent with prompt_follows waits for its prompt.
PROMPT_WAIT_S = 10.0

#: The prompt of a lookup sent with prompt_follows: awaits it (from the caller's stream).
LatePrompt = Callable[[], Awaitable[Prompt]]

PUT_BACK_WAIT_S = 0.5
"""How long a node_gone answer waits for its retention to be back (an etcd that does not
answer in time: it goes on being put back behind the answer)."""
_PUT_BACK = frozenset({Reason.NODE_GONE, Reason.STORE_UNAVAILABLE})
"""Answers whose claimed retention goes back: nobody can pull it now."""
_AWAITED = _PUT_BACK | {Reason.EXPIRED}
"""Answers after which a claim awaits something (its put-back, a deadline into its marker)."""
_OWN_TURN = Decision(False, Reason.OWN_TURN, "registered for this same request: left to the next turn")


@dataclass(frozen=True)
class LookupQuery:
    """A Lookup as asked."""

    tenant: str
    conversation_id: str
    prompt_tokens: int
    prompt_digests: bytes | None  # None: not given (an unverified pull; see policy.Prompt)
    peek: bool
    request_id: str = ""
    caller_verifies: bool = False
    """Answer without the prompt: the caller verifies it against D's sequence (`check`)."""


@dataclass(frozen=True)
class LookupResult:
    """A Lookup's answer: the decision, and whether a retention was claimed for it."""

    decision: Decision
    claimed: bool
    params_blob: bytes = b""
    """The retention's stored params, to which decision.params / decision.release apply."""
    check: Held | None = None
    """For a pull a caller verifies itself: D's sequence, to verify the prompt against."""
    threshold: int = 0
    """With `check`: the recompute threshold the caller applies."""


class Lookups:
    """Every lookup of this replica."""

    def __init__(
        self,
        claims: Claims,
        store: OwnedRetentions,
        nodes: NodeCache,
        settings: Settings,
        clock: Callable[[], float],
        budgets: Budgets,
    ) -> None:
        self._claims = claims
        self._budgets = budgets
        self._store = store
        self._nodes = nodes
        self._policy = settings.policy
        self._limits = settings.limits
        self._clock = clock

    async def lookup(self, q: LookupQuery, later: LatePrompt | None = None) -> LookupResult:
        """Claim the conversation's retention (unless `q.peek`) and decide on the prompt.

        With `later`, the prompt is still being computed by the caller: the claim's
        etcd round trip runs while `later()` is awaited (at most PROMPT_WAIT_S; a prompt
        that never comes is an empty one, and the claimed retention is released). It is
        called only then: a query refused first leaves no coroutine behind unawaited.
        """
        tenant = self._checked(q, later)
        if q.peek:
            return await self._peek(tenant, q)
        conversation = q.conversation_id
        now = claimed_at = self._clock()
        prompt, missing = Prompt(q.prompt_tokens, q.prompt_digests, q.caller_verifies), ""
        got: Claimed | None = None
        try:
            if later is None:
                got = await self._claims.claim_guarded(tenant, conversation, q.request_id, now)
            else:
                waiting = self._late_prompt(later, conversation)
                got, (prompt, missing) = await self._claims.claim_while(
                    tenant, conversation, q.request_id, now, waiting, self._confirm_early
                )
            now = self._clock()  # decide on the time it is now (the claim may have been slow)
            try:
                decision = await self._decide(got, prompt, missing, now)
            except asyncio.CancelledError:
                # The caller went away (its deadline, its stream): no answer reaches anyone,
                # so what the claim took goes back, for the next turn.
                self._claims.put_back(got, tenant, conversation)
                raise
        except StoreUnavailable as e:
            decision = _unavailable(e)
        taken = got.taken if got is not None else None
        if got is not None and taken is not None and decision.reason in _PUT_BACK:
            # Nobody is handed it: it goes back for a later turn, before the answer. node_gone:
            # its node may only be out of touch (its liveness lapsed while etcd had no quorum,
            # suspended while in doubt), D still holding the blocks (a node gone for good: it
            # expires, or the next registration replaces it). Back before the answer: the
            # turn's own registration, sent after it, then replaces it (handed back to be
            # freed), where it used to overtake a slow put-back and leave the blocks held for
            # nobody. store_unavailable (the node unreadable after an in-memory claim): it
            # was never handed out.
            putting = self._claims.put_back(got, tenant, conversation)
            if putting is not None:
                await asyncio.wait({putting}, timeout=PUT_BACK_WAIT_S)
            taken = None if decision.reason is Reason.STORE_UNAVAILABLE else taken
        if got is not None and taken is not None and decision.reason is Reason.EXPIRED:
            await self._claims.note_deadline(got, tenant, conversation, claimed_at, q.request_id)
        return self._answered(tenant, q, decision, taken, claimed=taken is not None)

    def lookup_now(self, q: LookupQuery) -> LookupResult | None:
        """`lookup` of a query sent with its prompt (or caller_verifies), answered without
        awaiting anything: when the conversation's shard is owned here with it in memory,
        the decision needs no read of D's node, and nothing goes back or into the marker
        after it (the usual turn: no task, no await). None: nothing was done (then
        `lookup`)."""
        if q.peek:
            return None
        tenant = self._checked(q, None)
        now = self._clock()
        prompt = Prompt(q.prompt_tokens, q.prompt_digests, q.caller_verifies)
        decided: list[Decision] = []

        def accept(retention: Retention | None, earlier: Claim | None) -> bool:
            if retention is None:
                decision: Decision | None = _without_retention(earlier, prompt, self._policy, now)
            else:
                decision = self._nodes.decision_now(retention, prompt, self._policy, now)
            if decision is None or (retention is not None and decision.reason in _AWAITED):
                return False
            decided.append(decision)
            return True

        got = self._claims.claim_now(tenant, q.conversation_id, q.request_id, now, accept)
        if got is None:
            return None
        return self._answered(tenant, q, decided[0], got.taken, claimed=got.taken is not None)

    def _confirm_early(self, got: Claimed) -> None:
        """A claim made while its prompt is still on its way: start the read of its node
        that a pull is confirmed on (NodeCache.decision), so that it overlaps the wait for
        the prompt instead of following it (about a millisecond of every pulling turn)."""
        if got.taken is not None and not got.own:
            self._nodes.confirm_soon(got.taken.engine_id)

    def _checked(self, q: LookupQuery, later: LatePrompt | None) -> str:
        """-> the query's tenant, its fields checked."""
        tenant = tenant_of(q.tenant, self._limits.max_id_bytes)
        check_id("conversation_id", q.conversation_id, self._limits.max_id_bytes)
        if later is not None and q.peek:
            raise InvalidArgument("prompt_follows is for claiming lookups, not peek")
        if q.caller_verifies:
            if later is not None or q.peek or q.prompt_tokens or q.prompt_digests is not None:
                raise InvalidArgument(
                    "caller_verifies is a claim without a prompt: no prompt_follows, peek, "
                    "prompt_tokens or prompt_digests with it"
                )
        elif later is None:
            check_prompt(q.prompt_tokens, q.prompt_digests, self._limits.max_tokens, required=not q.peek)
        return tenant

    async def _peek(self, tenant: str, q: LookupQuery) -> LookupResult:
        """What a lookup would answer, claiming nothing."""
        retention: Retention | None = None
        try:
            stored, claim = await self._store.read(tenant, q.conversation_id)
            retention = stored.retention if stored else None
            prompt = Prompt(q.prompt_tokens, q.prompt_digests)
            decision = await self._decision(retention, claim, prompt, self._clock())
        except StoreUnavailable as e:
            retention, decision = None, _unavailable(e)
        return self._answered(tenant, q, decision, retention, claimed=False)

    async def _decide(self, got: Claimed, prompt: Prompt, missing: str, now: float) -> Decision:
        """The decision on what a claim took, for `prompt` (`missing`: why a prompt_follows
        lookup has none: nothing to verify a pull against, so RECOMPUTE, releasing it)."""
        if got.own:
            return _OWN_TURN
        decision = await self._decision(got.taken, got.earlier, prompt, now)
        if missing and got.taken is not None:
            decision = replace(decision, reason=Reason.NO_PROMPT, detail=missing)
        return decision

    async def _decision(
        self, retention: Retention | None, claim: Claim | None, prompt: Prompt, now: float
    ) -> Decision:
        if retention is not None:
            return await self._nodes.decision(retention, prompt, self._policy, now)
        return _without_retention(claim, prompt, self._policy, now)

    async def _late_prompt(self, later: LatePrompt, conversation_id: str) -> tuple[Prompt, str]:
        """The prompt of a prompt_follows lookup -> (prompt, "") or (an empty prompt, why
        there is no usable one). The retention is claimed either way; an empty prompt
        never pulls, and the answer releases D's blocks."""
        try:
            async with asyncio.timeout(PROMPT_WAIT_S):
                prompt = await later()
        except TimeoutError:
            log.info("lookup.prompt_missing", conversation_id=conversation_id, waited_s=PROMPT_WAIT_S)
            return Prompt(0), f"no prompt within {PROMPT_WAIT_S:g}s"
        try:
            check_prompt(prompt.tokens, prompt.digests, self._limits.max_tokens)
        except InvalidArgument as e:
            log.warning("lookup.prompt_invalid", conversation_id=conversation_id, error=str(e))
            return Prompt(0), f"invalid prompt: {e}"
        if not prompt.tokens:
            return prompt, "the caller could not make the prompt"
        return prompt, ""

    def _answered(
        self, tenant: str, q: LookupQuery, decision: Decision, retention: Retention | None, claimed: bool
    ) -> LookupResult:
        """Count and log the answer. -> the result."""
        metrics.lookup(decision.pull, decision.reason.value)
        if claimed and retention is not None:
            self._budgets.claimed(tenant, q.conversation_id, retention, self._clock())
        if claimed:
            metrics.claim("pull" if decision.pull else "release" if decision.release else "dead")
            metrics.REUSABLE_TOKENS.inc(decision.reusable_tokens)
        log.debug(
            "retention.lookup",
            tenant=tenant,
            conversation_id=q.conversation_id,
            reason=decision.reason.value,
            claimed=claimed,
        )
        if q.caller_verifies and decision.pull and retention is not None:
            held = Held(retention.num_tokens, retention.block_size, retention.digests, retention.whole_only)
            return LookupResult(decision, claimed, retention.params, held, self._policy.recompute_threshold)
        return LookupResult(decision, claimed, retention.params if retention else b"")


def _without_retention(claim: Claim | None, prompt: Prompt, policy: Policy, now: float) -> Decision:
    """The decision when there is no retention: what the marker of the claim that took it
    says (`claim`), else no_lease."""
    if claim is not None:
        return decide_claimed(claim, now)
    return decide(None, None, prompt, policy, now)


def _unavailable(e: StoreUnavailable) -> Decision:
    """store_unavailable. (A retention claimed before etcd failed, reading the node, say, goes
    back: the claim was decided in its owner's memory, and nobody was handed it.)"""
    log.warning("lookup.store_unavailable", error=str(e))
    return Decision(False, Reason.STORE_UNAVAILABLE, str(e))

"""The retention budget of a decode node: which retentions to release early, and why.

Retention trades D's KV memory for reuse. A retention is worth what it is expected to
save per block-second it still holds (the rule's one home is `kvferry.retentionvalue`,
which `kvferry plan` replays too):

    value = reusable tokens x P(its conversation comes back before it expires)
            / (blocks x seconds left)

P is learned from the turn intervals kvferry observes (a lookup's time minus the
conversation's previous registration): `IntervalSketch` keeps them in a fixed
log-spaced histogram, and P is the chance a conversation idle for `age` seconds comes
back within the next `left` seconds, P(age < T <= age + left | T > age). Conversations
that ended (an explicit end, a retention that expired unclaimed) count as never coming
back, and so does part of a weak prior (PRIOR_WEIGHT pseudo-observations), so that a
conversation idle longer than every interval seen is not worth much.

`releases` picks, on one node, the least valuable retentions whose release brings its
retained blocks under the budget (a share of its pool) and its pool use under the
near-full mark. `idle` picks, on any node and whatever its pool, the retentions idle far
past every turn interval seen (see `idle_after`). Pure: no I/O, no clock (times are
passed in).
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from kvferry.retentionvalue import (
    DEFAULT_IDLE_FACTOR,
    IDLE_QUANTILE,
    blocks_for,
    p_return,
    value_per_block_second,
)
from kvferry.retentionvalue import IDLE_FLOOR_S as IDLE_FLOOR_S  # (the idle rule's, named here too)
from kvferry.retentionvalue import MIN_OBSERVED as MIN_OBSERVED
from kvferry.retentionvalue import idle_after as _idle_after

#: Upper edges (seconds) of the turn-interval histogram: 1 s to ~2 h, 4 buckets per doubling.
EDGES: tuple[float, ...] = tuple(2 ** (i / 4) for i in range(53))
#: The prior: PRIOR_WEIGHT pseudo-observations (they fade as intervals are seen), a share
#: PRIOR_P of them coming back (spread evenly over the histogram's buckets), the rest never.
PRIOR_P = 0.5
PRIOR_WEIGHT = 4.0
#: Default share of a D's pool its retentions may hold. Half: the other half is the room
#: running requests need for their prompts and answers, so a D at its budget still admits a
#: full batch of new work instead of waiting and answering 503 (what a fixed 480 s did to a
#: 4,096-block D after 8 s of sustained load); the least valuable half goes first, so
#: reuse loses little. 1.0 restores the old behaviour (no budget).
DEFAULT_SHARE = 0.5
#: Default near-full mark: above 90% pool use, retentions give room to requests first.
DEFAULT_NEAR_FULL = 0.9


class Reason(enum.StrEnum):
    """Why a retention was released before a turn claimed it (the metric's label)."""

    BUDGET = "budget"
    """Its node's retained blocks were over the budget share of its pool."""
    NEAR_FULL = "near_full"
    """Its node's pool use was over the near-full mark."""
    CONVERSATION_END = "conversation_end"
    """The client said the conversation ended."""
    EXPIRY = "expiry"
    """It reached its deadline unclaimed (D freed it)."""
    ORPHAN = "orphan"
    """Blocks pinned with no retention (sidecar.retentions' orphan release)."""
    IDLE = "idle"
    """Idle far past every turn interval seen: its conversation is not coming back."""
    FAILOVER = "failover"
    """Found at a shard's unclean takeover: its last owner may have handed it out from
    memory, so it is spent (controlplane.owners)."""


@dataclass
class IntervalSketch:
    """Turn intervals seen (a histogram over EDGES, plus an overflow bucket of the
    conversations that never came back)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(EDGES) + 1))

    def observe(self, interval_s: float) -> None:
        """A conversation came back `interval_s` after its previous turn."""
        if math.isnan(interval_s):
            return
        self.counts[bisect.bisect_left(EDGES, max(interval_s, 0.0))] += 1

    def never(self) -> None:
        """A conversation did not come back (ended, or its retention expired unclaimed)."""
        self.counts[-1] += 1

    @property
    def total(self) -> int:
        """Observations, the conversations that never came back included."""
        return sum(self.counts)

    @property
    def observed(self) -> int:
        """Turn intervals seen (conversations that came back)."""
        return sum(self.counts[:-1])

    def quantile(self, q: float) -> float:
        """The `q`-quantile of the intervals seen: the upper edge of the bucket it falls in
        (0.0 when none were seen)."""
        need = min(max(q, 0.0), 1.0) * self.observed
        run = 0
        for edge, c in zip(EDGES, self.counts, strict=False):
            run += c
            if c and run >= need:
                return edge
        return 0.0

    def _beyond(self, t: float) -> float:
        """Observations (the prior's included) with an interval above `t` (the bucket `t`
        falls in, pro rata)."""
        per_bucket = PRIOR_WEIGHT * PRIOR_P / len(EDGES)
        weights = [c + per_bucket for c in self.counts[:-1]]
        weights.append(self.counts[-1] + PRIOR_WEIGHT * (1 - PRIOR_P))
        i = bisect.bisect_left(EDGES, max(t, 0.0))
        above = float(sum(weights[i + 1 :]))
        if i < len(EDGES):
            lo = EDGES[i - 1] if i else 0.0
            share = (EDGES[i] - max(t, 0.0)) / (EDGES[i] - lo)
            above += weights[i] * min(max(share, 0.0), 1.0)
        else:
            above += weights[i]
        return above

    def p_return(self, age_s: float, left_s: float) -> float:
        """P(the conversation comes back within `left_s` | idle for `age_s` so far)."""
        return p_return(self._beyond, age_s, left_s)


class Held(msgspec.Struct, frozen=True, gc=False):
    """A live retention as the budget sees it. (Untracked by the cyclic garbage collector:
    a replica holds one per live retention of its attached nodes, and a gauge scan makes
    one per retention in etcd; none holds a container.)"""

    tenant: str
    conversation_id: str
    num_tokens: int
    block_size: int
    created_at: float
    expires_at: float
    revision: int
    """The etcd revision of the record: a release deletes exactly this one."""

    @property
    def blocks(self) -> int:
        """The D blocks it holds (a partial last block is a whole one)."""
        return blocks_for(self.num_tokens, self.block_size)


@dataclass(frozen=True)
class Pool:
    """A decode node's KV pool, as its sidecar last reported it."""

    blocks: int
    """Blocks in all (0 = unknown)."""
    usage: float
    """Share in use, 0..1."""


@dataclass(frozen=True)
class Budget:
    """The operator's limits on retained memory (--retention-budget, --near-full)."""

    share: float
    """Retained blocks may hold at most this share of a node's pool (1.0 = no limit)."""
    near_full: float
    """Pool use above this share releases retentions first (1.0 = never)."""
    idle_factor: float = DEFAULT_IDLE_FACTOR
    """--idle-release: a retention idle this many times the IDLE_QUANTILE interval is
    released (0 = never: held to its deadline)."""

    def validate(self) -> None:
        """Raise ValueError for a share outside (0, 1] or an idle factor not 0 or more."""
        for name, v in (("retention budget", self.share), ("near-full mark", self.near_full)):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be a share of the pool in (0, 1], not {v}")
        if not (math.isfinite(self.idle_factor) and self.idle_factor >= 0.0):
            raise ValueError(f"idle release factor must be 0 (off) or positive, not {self.idle_factor}")


def value(h: Held, now: float, sketch: IntervalSketch) -> float:
    """Tokens expected to be reused per block-second the retention still holds."""
    left = h.expires_at - now
    if left <= 0:
        return 0.0
    return value_per_block_second(h.num_tokens, h.blocks, sketch.p_return(now - h.created_at, left), left)


def releases(
    pool: Pool, held: Iterable[Held], budget: Budget, now: float, sketch: IntervalSketch
) -> list[tuple[Held, Reason]]:
    """The retentions to release on one node, least valuable first, each with its reason:
    enough to bring its retained blocks to at most `budget.share` of the pool, then its pool
    use to at most `budget.near_full` (retained blocks only: what else is in use is the
    clients'). Nothing when the pool is unknown."""
    if pool.blocks <= 0:
        return []
    live = [h for h in held if h.expires_at > now]
    retained = sum(h.blocks for h in live)
    over_budget = retained - math.floor(budget.share * pool.blocks)
    used = round(min(max(pool.usage, 0.0), 1.0) * pool.blocks)
    over_full = used - math.floor(budget.near_full * pool.blocks) if budget.near_full < 1.0 else 0
    if over_budget <= 0 and over_full <= 0:
        return []
    ranked = sorted(live, key=lambda h: (value(h, now, sketch), h.expires_at, h.conversation_id))
    return _take(ranked, over_budget, over_full)


def _take(ranked: Sequence[Held], over_budget: int, over_full: int) -> list[tuple[Held, Reason]]:
    out: list[tuple[Held, Reason]] = []
    freed = 0
    for h in ranked:
        if freed >= over_budget and freed >= over_full:
            break
        out.append((h, Reason.BUDGET if freed < over_budget else Reason.NEAR_FULL))
        freed += h.blocks
    return out


def idle_after(sketch: IntervalSketch, factor: float) -> float | None:
    """Seconds idle after which a retention is released, or None (the rule is off: factor
    0, or fewer than MIN_OBSERVED intervals seen).

    Why: a fixed deadline (vLLM's 480 s) is blunt. Once a conversation has been idle
    `factor` times longer than 99% of the conversations seen took to come back, it almost
    surely is not coming back, and every second more it is held costs D's memory for
    nothing: a conversation's last turn (most of them are one) stays pinned to the
    deadline. The rule needs no budget pressure: it is what takes block-seconds per reused
    token down on a node that is not full.

    The cost: a conversation that pauses longer than that recomputes its prompt (one in a
    few hundred, with factor 2 and q 0.99, when the intervals to come are like those seen).
    Its interval is then not seen, so the sketch learns no interval longer than the
    threshold; IDLE_FLOOR_S, and the quantile's bucket edge (rounding up), keep it from
    shrinking far below the intervals actually seen."""
    return _idle_after(sketch.quantile(IDLE_QUANTILE), sketch.observed, factor)


def idle(held: Iterable[Held], now: float, sketch: IntervalSketch, factor: float) -> list[Held]:
    """The live retentions idle (now - created_at) longer than `idle_after`, oldest first."""
    after = idle_after(sketch, factor)
    if after is None:
        return []
    out = [h for h in held if h.expires_at > now and now - h.created_at > after]
    return sorted(out, key=lambda h: (h.created_at, h.conversation_id))

"""What a retention is worth, and when one is idle for good: the rules the daemon's budget
(`controlplane.budget`) applies and `kvferry plan` (`planner.value`) replays. Pure.

A retention is worth what it is expected to save per block-second it still holds:

    value = reusable tokens x P(its conversation comes back before it expires)
            / (blocks x seconds left)

P is learned from the turn intervals seen (a turn's arrival minus its conversation's
previous turn): for a retention idle `age` seconds with `left` seconds to go,

    P = P(age < T <= age + left | T > age) = (S(age) - S(age + left)) / S(age),

where S(t) counts the observations with an interval above t, the conversations that
never came back (ended, or their retention expired unclaimed) among them. How S is kept
is the learner's: the daemon's is a fixed log-spaced histogram with a weak prior
(`controlplane.budget.IntervalSketch`), the planner's the exact intervals of a replay
(`planner.value.ReturnIntervals`).

The idle rule: once MIN_OBSERVED intervals were seen, a retention idle longer than a
factor (DEFAULT_IDLE_FACTOR) times the IDLE_QUANTILE interval, and at least IDLE_FLOOR_S,
is released (`idle_after`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

DEFAULT_IDLE_FACTOR = 2.0
"""The daemon's default --idle-release FACTOR (0 = off: retentions are held to their
deadline, the fixed TTL of old)."""
IDLE_QUANTILE = 0.99
"""The turn interval the idle rule scales: 99% of the conversations seen came back sooner."""
MIN_OBSERVED = 50
"""Intervals to see before the idle rule releases anything (fewer say too little)."""
IDLE_FLOOR_S = 10.0
"""Never idle-release a retention younger than this, whatever the intervals seen."""


def p_return(survivors: Callable[[float], float], age_s: float, left_s: float) -> float:
    """P(the conversation comes back within `left_s` | idle `age_s` so far), from
    `survivors(t)`: the observations with an interval above t (0 when there are none)."""
    if left_s <= 0 or math.isnan(age_s) or math.isnan(left_s):
        return 0.0
    alive = survivors(age_s)
    if alive <= 0:
        return 0.0
    return min(max((alive - survivors(age_s + left_s)) / alive, 0.0), 1.0)


def value_per_block_second(reusable_tokens: int, blocks: int, p: float, left_s: float) -> float:
    """Tokens a retention is expected to save per block-second it still holds (0 for one
    with no blocks or no time left)."""
    if blocks <= 0 or left_s <= 0:
        return 0.0
    return reusable_tokens * p / (blocks * left_s)


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` tokens take (a partial last block is a whole one)."""
    return -(-tokens // max(block_size, 1)) if tokens > 0 else 0


def idle_after(quantile_s: float, observed: int, factor: float) -> float | None:
    """Seconds idle after which a retention is released, given the IDLE_QUANTILE interval
    seen (`quantile_s`) and how many intervals were seen; None: the rule is off (`factor`
    0) or has seen fewer than MIN_OBSERVED."""
    if factor <= 0.0 or observed < MIN_OBSERVED:
        return None
    return max(factor * quantile_s, IDLE_FLOOR_S)

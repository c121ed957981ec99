"""The value of a retention, as the daemon's budget rule reckons it. Pure.

Value per block-second = reusable tokens x P(the conversation comes back before the
retention expires) / (blocks x remaining seconds). P is learned from the intervals
observed between a turn's end and its conversation's next turn (`ReturnIntervals`):
given a retention `age` seconds old with `remaining` seconds left,

    P = #(age < gap <= age + remaining) / #(gap > age),

where retentions that expired (or were released) unclaimed count as gaps of infinity:
the conversations that never came back. With nothing observed yet, P is `PRIOR`.

(The daemon's version lives in controlplane/ — issue 22's budget lane; this copy keeps the
planner free of the daemon's packages, with the same formula. The lead unifies them.)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

PRIOR = 0.5
"""P(return) before any interval was observed."""


@dataclass
class ReturnIntervals:
    """Observed return intervals (seconds), and how many retentions were never claimed."""

    gaps: list[float] = field(default_factory=list)
    """Sorted."""
    never: int = 0

    def returned(self, gap_s: float) -> None:
        """A conversation came back `gap_s` after its previous turn ended."""
        bisect.insort(self.gaps, max(0.0, gap_s))

    def expired(self) -> None:
        """A retention ended unclaimed (its conversation did not come back in time)."""
        self.never += 1

    def p_return(self, age_s: float, remaining_s: float) -> float:
        """P(the conversation comes back within `remaining_s`, given `age_s` passed without)."""
        total = len(self.gaps) + self.never
        if total == 0:
            return PRIOR
        later = len(self.gaps) - bisect.bisect_right(self.gaps, age_s) + self.never
        if later == 0:
            return 0.0
        within = bisect.bisect_right(self.gaps, age_s + max(0.0, remaining_s)) - bisect.bisect_right(
            self.gaps, age_s
        )
        return within / later


IDLE_FACTOR = 2.0
IDLE_QUANTILE = 0.99
MIN_OBSERVED = 50
IDLE_FLOOR_S = 10.0
"""The daemon's idle release (controlplane.budget: --idle-release 2.0 by default): once
MIN_OBSERVED return intervals were seen, a retention idle longer than IDLE_FACTOR x their
IDLE_QUANTILE, and at least IDLE_FLOOR_S, is released. (The daemon rounds the quantile up
to its histogram's bucket edge; here it is the exact one.)"""


def idle_after(intervals: ReturnIntervals, factor: float = IDLE_FACTOR) -> float | None:
    """Seconds idle after which a retention is released (None: not yet, or off)."""
    if factor <= 0 or len(intervals.gaps) < MIN_OBSERVED:
        return None
    q = intervals.gaps[min(len(intervals.gaps) - 1, int(IDLE_QUANTILE * len(intervals.gaps)))]
    return max(factor * q, IDLE_FLOOR_S)


def value_per_block_second(reusable_tokens: int, blocks: int, p_return: float, remaining_s: float) -> float:
    """What holding a retention is expected to save per block-second it still holds."""
    if blocks <= 0:
        return 0.0
    if remaining_s <= 0:
        return 0.0
    return reusable_tokens * p_return / (blocks * remaining_s)


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` tokens take."""
    return math.ceil(tokens / block_size) if tokens > 0 else 0

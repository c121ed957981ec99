"""The return-interval learner of a replay; the value rule itself is the daemon's. Pure.

The rule (value per block-second = reusable tokens x P(the conversation comes back before
the retention expires) / (blocks x remaining seconds), P conditional on the age already
passed, and the idle release) lives in `kvferry.retentionvalue`, which the daemon's budget
(`controlplane.budget`) applies too. What is the planner's own is how the intervals are
kept: `ReturnIntervals` keeps the exact intervals a replay observes between a turn's end
and its conversation's next turn (the daemon keeps a histogram, with a weak prior), where
retentions that expired (or were released) unclaimed count as gaps of infinity: the
conversations that never came back. With nothing observed yet, P is `PRIOR`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvferry import retentionvalue
from kvferry.retentionvalue import DEFAULT_IDLE_FACTOR, IDLE_QUANTILE

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

    def survivors(self, t: float) -> float:
        """Observations with an interval above `t`, those never claimed included."""
        return float(len(self.gaps) - bisect.bisect_right(self.gaps, t) + self.never)

    def p_return(self, age_s: float, remaining_s: float) -> float:
        """P(the conversation comes back within `remaining_s`, given `age_s` passed without)."""
        if not self.gaps and not self.never:
            return PRIOR
        return retentionvalue.p_return(self.survivors, age_s, remaining_s)


def idle_after(intervals: ReturnIntervals, factor: float = DEFAULT_IDLE_FACTOR) -> float | None:
    """Seconds idle after which the daemon's idle release frees a retention (None: not yet,
    or off). (The daemon rounds the quantile up to its histogram's bucket edge; here it is
    the exact one.)"""
    gaps = intervals.gaps
    quantile = gaps[min(len(gaps) - 1, int(IDLE_QUANTILE * len(gaps)))] if gaps else 0.0
    return retentionvalue.idle_after(quantile, len(gaps), factor)

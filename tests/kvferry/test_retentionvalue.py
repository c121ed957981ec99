"""The retention value rule both the daemon's budget and `kvferry plan` apply."""

from __future__ import annotations

import math

import pytest

from controlplane.budget import IntervalSketch
from kvferry.retentionvalue import (
    IDLE_FLOOR_S,
    MIN_OBSERVED,
    blocks_for,
    idle_after,
    p_return,
    value_per_block_second,
)
from planner.value import ReturnIntervals


def test_p_return_is_the_share_of_the_survivors_that_come_back_within_the_time_left() -> None:
    gaps = [5.0, 10.0, 20.0, 40.0]  # and one conversation that never came back

    def survivors(t: float) -> float:
        return sum(g > t for g in gaps) + 1.0

    assert p_return(survivors, 0.0, 15.0) == pytest.approx(2 / 5)
    assert p_return(survivors, 15.0, 30.0) == pytest.approx(2 / 3)  # (given 15 s passed)
    assert p_return(survivors, 50.0, 100.0) == 0.0  # (only the one that never comes back)
    assert p_return(survivors, 0.0, 0.0) == 0.0
    assert p_return(survivors, math.nan, 10.0) == 0.0
    assert p_return(lambda t: 0.0, 0.0, 10.0) == 0.0  # (nothing seen: the learner's prior)


def test_the_daemons_and_the_planners_learners_both_use_it() -> None:
    sketch, exact = IntervalSketch(), ReturnIntervals()
    for gap in (3.0, 7.0, 30.0, 300.0):
        sketch.observe(gap)
        exact.returned(gap)
    exact.expired()
    sketch.never()
    assert exact.p_return(10.0, 100.0) == pytest.approx(1 / 3)
    # (the daemon's histogram adds a weak prior: near the exact figure, not equal)
    assert sketch.p_return(10.0, 100.0) == pytest.approx(1 / 3, abs=0.1)


def test_value_is_tokens_times_p_per_block_second() -> None:
    assert value_per_block_second(1600, 100, 0.5, 20.0) == pytest.approx(0.4)
    assert value_per_block_second(1600, 0, 0.5, 20.0) == 0.0
    assert value_per_block_second(1600, 100, 0.5, 0.0) == 0.0
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_idle_after_needs_enough_intervals_and_keeps_its_floor() -> None:
    assert idle_after(30.0, MIN_OBSERVED - 1, 2.0) is None
    assert idle_after(30.0, MIN_OBSERVED, 0.0) is None
    assert idle_after(30.0, MIN_OBSERVED, 2.0) == 60.0
    assert idle_after(1.0, MIN_OBSERVED, 2.0) == IDLE_FLOOR_S

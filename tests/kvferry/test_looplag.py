"""kvferry.looplag: the sliding largest lag, and a stalled loop measured."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvferry.looplag import LagWindow, LoopLag
from tests.polling import eventually


def test_the_window_keeps_the_largest_lag_until_it_is_older_than_the_window() -> None:
    w = LagWindow(window_s=1.0)
    assert w.largest(0.0) == 0.0
    w.add(10.0, 0.3)
    w.add(10.2, 0.1)
    assert w.largest(10.5) == 0.3
    w.add(10.6, 0.2)
    assert w.largest(11.05) == 0.2  # the 0.3 of 10.0 is out of the window
    assert w.largest(11.5) == 0.2  # (the 0.2 of 10.6 is still in)
    assert w.largest(11.7) == 0.0
    w.add(12.0, -0.5)  # a callback early (clock granularity) counts as no lag
    assert w.largest(12.0) == 0.0


def test_a_larger_lag_replaces_smaller_ones_before_it() -> None:
    w = LagWindow(window_s=1.0)
    for i, lag in enumerate((0.1, 0.2, 0.05, 0.4)):
        w.add(float(i) / 10, lag)
    assert w.largest(0.5) == 0.4


async def test_a_blocked_loop_is_measured() -> None:
    lag = LoopLag(tick_s=0.01, window_s=30.0)
    task = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 (the point: the loop stalls, no callback runs meanwhile)

        async def measured() -> bool:
            return lag.recent_s() >= 0.25

        await eventually(measured, within=30)
        assert lag.recent_s() == pytest.approx(0.3, abs=0.25)
    finally:
        task.cancel()

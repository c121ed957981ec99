"""kvferry.logs: the helpers that keep repeated warnings from flooding the log."""

from __future__ import annotations

from kvferry.logs import Throttle


def test_throttle_logs_the_first_then_one_per_interval_with_what_it_left_out() -> None:
    t = Throttle(every_s=10.0)
    assert t.due(100.0) == 0  # the first: logged
    assert [t.due(100.0 + i) for i in range(1, 10)] == [None] * 9
    assert t.due(110.0) == 9  # the next line says how many were left out
    assert t.due(115.0) is None
    assert t.due(200.0) == 1

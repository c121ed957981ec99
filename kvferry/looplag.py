"""How far behind this process's event loop runs: the lag of a callback due every tick.

A process whose cores are saturated runs its callbacks late; an answer that reached its
socket in time is then read late too. A deadline that counts from before such a stall
says "the peer was late" when the peer was not: a router that takes that for a slow
daemon skips reuse (and backs off from the daemon) exactly when the machine is busiest,
and recomputes the histories it could have pulled. `LoopLag` measures the stall, so a
wait can make room for it and a late answer can be told from a late loop.

`LagWindow` is the pure part (the largest lag over a sliding window); `LoopLag` the task
that feeds it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

TICK_S = 0.02
"""How often the loop is asked to run a callback (its lag is the measurement)."""
WINDOW_S = 1.0
"""How far back the largest lag is remembered."""


class LagWindow:
    """The largest lag observed over the last `window_s` seconds."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (at, lag), lags decreasing

    def add(self, at: float, lag_s: float) -> None:
        """A callback due at `at - lag_s` ran at `at`."""
        lag_s = max(lag_s, 0.0)
        while self._samples and self._samples[-1][1] <= lag_s:
            self._samples.pop()  # (never the largest again: a later sample is at least as big)
        self._samples.append((at, lag_s))
        self._expire(at)

    def largest(self, now: float) -> float:
        """The largest lag seen within the window before `now` (0.0: none)."""
        self._expire(now)
        return self._samples[0][1] if self._samples else 0.0

    def _expire(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()


class LoopLag:
    """The running loop's recent lag, measured by a task (`run`) every `tick_s`."""

    def __init__(self, tick_s: float = TICK_S, window_s: float = WINDOW_S) -> None:
        self._tick_s = tick_s
        self._window = LagWindow(window_s)

    def recent_s(self) -> float:
        """The largest lag of the last window: how late this loop has been running callbacks."""
        return self._window.largest(time.monotonic())

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            due = time.monotonic() + self._tick_s
            await asyncio.sleep(self._tick_s)
            now = time.monotonic()
            self._window.add(now, now - due)

"""What stalls the daemon's event loop, as metrics: how late it runs timers (every request
waits behind whatever held it) and the cyclic garbage collector's pauses.

A lookup tail has two usual causes here: the loop held (a GC pause, a long callback, no
core free), and etcd slow to answer a confirming read (kvferry_lookup_wait_seconds). With
these two histograms beside that one, /metrics tells which; bench.lookup_tail and
bench.fsync_tail used to need ad-hoc hooks in the process for it.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from controlplane import metrics

LAG_TICK_S = 0.02
"""How often the lag watch wakes: 50 timers a second, little CPU, and a stall shorter than
this is still seen when a tick falls in it."""


async def watch_loop_lag(tick_s: float = LAG_TICK_S) -> None:
    """Observe, every `tick_s`, how much later than asked the loop woke this task."""
    clock = time.perf_counter  # (uvloop's loop.time() counts whole milliseconds)
    while True:
        asked = clock()
        await asyncio.sleep(tick_s)
        metrics.LOOP_LAG.observe(max(0.0, clock() - asked - tick_s))


class GcPauses:
    """Times each cyclic collection of this process into kvferry_gc_pause_seconds (a
    gc.callbacks entry, installed once per process)."""

    _installed: GcPauses | None = None

    def __init__(self) -> None:
        self._started = 0.0

    @classmethod
    def install(cls) -> GcPauses:
        """The process's one GcPauses, installed on first call."""
        if cls._installed is None:
            cls._installed = cls()
            gc.callbacks.append(cls._installed._on_gc)
        return cls._installed

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            metrics.GC_PAUSES.labels(str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = 0.0

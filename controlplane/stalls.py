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


_gc_started = 0.0  # perf_counter() at the start of the collection under way (0: none)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
    elif _gc_started:
        metrics.GC_PAUSES.labels(str(info["generation"])).observe(time.perf_counter() - _gc_started)
        _gc_started = 0.0


def time_gc_pauses() -> None:
    """Time each cyclic collection of this process into kvferry_gc_pause_seconds (a
    gc.callbacks entry; a second call adds none)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)

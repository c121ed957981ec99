"""Which cores the benchmark's processes may run on.

On this 2-core machine the daemon shares its cores with the load generator (which in
a deployment is a fleet of routers on other machines) and etcd (its own nodes, see
deploy/kubernetes). When the scheduler puts one of them next to the daemon's serving
thread, that thread waits. In 15 runs of ``bench.lookup_tail --rate 2000`` with all
three free to run anywhere, the stream's p99 was 10-169 ms for the same code (median
about 37 ms), the daemon's thread at 0.7-0.8 of a core. With the load generator and etcd
kept on core 0 while lookups were offered, and the daemon free to use both cores, it was
4.8-22 ms in 7 runs (median 10 ms). `confined` sets up that layout: the daemon with a
core nobody else runs on, as its CPU request gives it in deploy/. What is left of the
tail then is the daemon's own work: about 0.35 ms of CPU per lookup against 0.16 ms for
a server doing none (bench.echo).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

OTHERS_CORE = 0
"""The core the load generator and etcd are confined to; the daemon keeps every core."""
EVERY_CORE = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
"""The cores this process could run on when it started (before any `confined`)."""


def can_confine() -> bool:
    """Whether this machine has a core to leave to the daemon alone."""
    return hasattr(os, "sched_setaffinity") and len(EVERY_CORE) >= 2


def _threads(pid: int) -> list[int]:
    """Every thread of process `pid` (a thread that ended meanwhile is left out later)."""
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        return []


def _set(tids: dict[int, set[int]]) -> None:
    for tid, cpus in tids.items():
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def confined(pids: list[int], cpus: set[int]) -> Iterator[None]:
    """Every thread of each of `pids` runs on `cpus` only, until the block ends (threads
    started meanwhile inherit it from the thread that starts them); then each has the
    cores it had back. No `pids`: nothing changes (the layout with every process free)."""
    before: dict[int, set[int]] = {}
    for tid in (tid for pid in pids for tid in _threads(pid)):
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            before[tid] = os.sched_getaffinity(tid)
    _set({tid: cpus for tid in before})
    try:
        yield
    finally:
        now = {tid: before.get(tid, set(EVERY_CORE)) for pid in pids for tid in _threads(pid)}
        _set(now)

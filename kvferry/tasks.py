"""Stopping background tasks without swallowing the caller's own cancellation.

`with suppress(CancelledError): await task` after `task.cancel()` also eats a
cancellation aimed at the *awaiting* task, which then runs on (a loop that can
never be stopped). `asyncio.wait` never raises the awaited tasks' errors, so the
caller's cancellation is the only one that can reach it.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Coroutine, Iterable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def spawn(
    coro: Coroutine[Any, Any, Any], tasks: set[asyncio.Task[Any]], name: str | None = None
) -> asyncio.Task[Any]:
    """Run `coro` as a task kept in `tasks` until it ends (a task nobody holds may be
    collected before it is done); `cancel_and_wait(tasks)` ends them."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel `tasks` and wait until they have ended; log any that failed."""
    pending = [t for t in tasks if t is not None]
    for t in pending:
        t.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    for t in pending:
        if not t.cancelled() and t.exception() is not None:
            log.warning("task.failed", task=t.get_name(), error=repr(t.exception()))


def run_main(main: Coroutine[Any, Any, int], use_uvloop: bool = True) -> int:
    """Run a process's main coroutine on uvloop when it is installed (and wanted).

    gRPC's asyncio layer pays a loop wake-up per message; uvloop halves that
    cost (measured here: 146 -> 78 us of server CPU per stream message at one
    in flight). Every kvferry process and benchmark starts through this.
    """
    quiet_gc()
    try:
        import uvloop
    except ImportError:
        use_uvloop = False
    return uvloop.run(main) if use_uvloop else asyncio.run(main)


def run_process(name: str, main: Coroutine[Any, Any, int], use_uvloop: bool = True) -> int:
    """`run_main` for a kvferry process: an OSError at start-up (a port taken, a data dir it
    cannot write) is one line on stderr and exit 1, not a traceback."""
    try:
        return run_main(main, use_uvloop)
    except OSError as e:
        print(f"kvferry {name}: {e}", file=sys.stderr)
        return 1


def quiet_gc() -> None:
    """Keep the cyclic garbage collector from pausing a serving process.

    A full collection walks every tracked object: with grpc, protobuf, aiohttp and
    their descriptors loaded that took 15-17 ms here, and at 1,000 lookups/s CPython
    ran one every few seconds in the daemon and in its clients (a lookup waiting
    behind one is the latency tail). What exists at start-up (modules, descriptors,
    settings) is never garbage: freezing it keeps it out of every later collection,
    and a larger first-generation threshold makes the cheap collections rarer
    (measured: 5 full collections in 10 s at 1,000 lookups/s before, none after).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)

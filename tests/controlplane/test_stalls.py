"""The daemon's own stalls as metrics (controlplane.stalls): a held event loop shows as
lag, and each cyclic collection as a pause of its generation."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import REGISTRY

from controlplane import stalls
from tests.polling import eventually


def _lag(le: str) -> float:
    return REGISTRY.get_sample_value("kvferry_event_loop_lag_seconds_bucket", {"le": le}) or 0.0


def _lags() -> float:
    return REGISTRY.get_sample_value("kvferry_event_loop_lag_seconds_count") or 0.0


async def test_a_held_loop_shows_as_lag() -> None:
    watching = asyncio.create_task(stalls.watch_loop_lag(tick_s=0.005))
    try:
        ticks = _lags()
        await eventually(lambda: _lags() > ticks)  # (watching)
        slow_before = _lags() - _lag("0.1")
        time.sleep(0.15)  # noqa: ASYNC251 - the stall under test: the loop held 150 ms
        await eventually(lambda: _lags() - _lag("0.1") > slow_before)
    finally:
        watching.cancel()


def test_each_collection_is_timed_by_its_generation() -> None:
    stalls.time_gc_pauses()
    stalls.time_gc_pauses()
    assert gc.callbacks.count(stalls._on_gc) == 1  # (installed once)
    key = ("kvferry_gc_pause_seconds_count", {"generation": "2"})
    before = REGISTRY.get_sample_value(*key) or 0.0
    gc.collect()
    assert REGISTRY.get_sample_value(*key) == before + 1

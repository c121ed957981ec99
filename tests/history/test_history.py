"""Single use under replica faults (issue 23 goal 2's proof, the short variant): three
daemon replicas (processes) on one etcd, fake decode sidecars and clients contending for
the same conversations through different replicas, with registrations replacing
retentions, revokes and conversation ends, budget releases and lookups cancelled at
deadlines near a claim's latency; one replica is SIGKILLed and restarted, another
stopped (SIGSTOP) for longer than any TTL the daemon uses. The recorded history must
show no retention handed out twice, after its release, or where it was never
registered (tests.history.checker). The long variant, with etcd's faults too, is
tests/faults/test_history_faults.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from tests.history.harness import (
    explained,
    kill_and_restart,
    longest_ttl_s,
    pause,
    pulled,
    start_replicas,
    stop_replicas,
    until,
    verdict,
)
from tests.history.recorder import Recorder
from tests.history.workload import running

PAUSE_S = min(longest_ttl_s() + 2.0, 20.0)
"""The stopped replica's pause: past every TTL (capped: the variant must stay short)."""


@pytest.mark.timeout(150)
async def test_single_use_under_replica_faults(etcd_endpoint: str, tmp_path: Path) -> None:
    recorder = Recorder()
    daemons = await start_replicas(tmp_path, (etcd_endpoint,), f"/hist-{uuid.uuid4().hex[:8]}", 3)
    try:
        async with running([d.address for d in daemons], recorder=recorder):
            await until(recorder, pulled, 20, 0.0)
            await kill_and_restart(recorder, daemons[0])
            # one replica stopped and, meanwhile, another killed: one of three left serving
            await asyncio.gather(pause(recorder, daemons[1], PAUSE_S), kill_and_restart(recorder, daemons[2]))
            await until(recorder, pulled, 20, time.monotonic())
    finally:
        await stop_replicas(daemons)
    report = verdict(recorder, "replica kill + pause")
    assert report.ok, explained(report, recorder)
    counts = report.counts
    assert counts["handed out by lookup"] >= 40
    assert counts["lookup unknown"] > 0, "no lookup raced its deadline: nothing was put back"

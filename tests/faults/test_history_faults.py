"""Single use under replica and etcd faults (issue 23 goal 2's proof, the long variant of
tests/history/test_history.py): the same recorded workload on three daemon replicas over
the 3-member etcd cluster, while a replica is SIGKILLed and restarted, one is stopped past
every TTL the daemon uses, etcd's leader is killed, and quorum is lost for 25 s. The
history must keep single use (tests.history.checker)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from tests.faults.cluster import EtcdCluster
from tests.history.harness import (
    judge,
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

PAUSE_S = longest_ttl_s() + 2.0
"""The stopped replica's pause: past every TTL the daemon's settings hold."""
QUORUM_LOST_S = 25.0
"""As tests/faults/test_faults.py's quorum loss (the issue's figure)."""
PULLS_BETWEEN = 20
"""Lookups handed a retention between two faults: the workload got going again."""


async def leader_killed(cluster: EtcdCluster, recorder: Recorder) -> None:
    """Kill etcd's leader; start it again once the workload pulled without it."""
    leader = await cluster.wait_healthy()
    killed = time.monotonic()
    await cluster.kill(leader)
    await until(recorder, pulled, PULLS_BETWEEN, killed)
    await cluster.start_member(leader)
    await cluster.wait_healthy()


async def quorum_lost(cluster: EtcdCluster) -> None:
    """Kill two of the three members (the leader among them) for QUORUM_LOST_S."""
    leader = await cluster.wait_healthy()
    stopped = [leader, next(m for m in cluster.members if m is not leader)]
    for m in stopped:
        await cluster.kill(m)
    await asyncio.sleep(QUORUM_LOST_S)  # (the fault's length)
    for m in stopped:
        await cluster.start_member(m)
    left = next(m for m in cluster.members if m not in stopped)
    await cluster.wait_writable(left)
    await cluster.wait_healthy()


@pytest.mark.timeout(300)
async def test_single_use_under_replica_and_etcd_faults(tmp_path: Path) -> None:
    recorder = Recorder()
    cluster = EtcdCluster(tmp_path)
    try:
        await cluster.start()
        prefix = f"/hist-{uuid.uuid4().hex[:8]}"
        daemons = await start_replicas(tmp_path, cluster.endpoints, prefix, 3)
        try:
            async with running([d.address for d in daemons], recorder=recorder):
                await until(recorder, pulled, PULLS_BETWEEN, 0.0)
                await kill_and_restart(recorder, daemons[0])
                await pause(recorder, daemons[1], PAUSE_S)
                await leader_killed(cluster, recorder)
                # etcd's leader killed again while a replica is stopped
                await asyncio.gather(pause(recorder, daemons[2], PAUSE_S), leader_killed(cluster, recorder))
                await quorum_lost(cluster)
                await until(recorder, pulled, PULLS_BETWEEN, time.monotonic())
        finally:
            await stop_replicas(daemons)
    finally:
        await cluster.stop()
    report = verdict(
        recorder,
        "3 replicas, 3-member etcd: replica killed, 2 stopped, leader killed twice, quorum lost",
        tmp_path,
    )
    assert report.counts["handed out by lookup"] >= 5 * PULLS_BETWEEN
    judge(report, recorder)

"""Single use under replica faults (issue 23 goal 2's proof, the short variant): three
daemon replicas (processes) on one etcd, fake decode sidecars and clients contending for
the same conversations through different replicas, with registrations replacing
retentions, revokes and conversation ends, budget releases and lookups cancelled at
deadlines near a claim's latency, retentions expiring; one replica is SIGKILLed and
restarted, then another is stopped (SIGSTOP) for longer than any TTL the daemon uses
while the third is killed and restarted; the engines restart about every second too. The
recorded history must show no retention handed out twice, after its release or deadline,
after a newer registration, after its engine restarted, or where it was never registered
(tests.history.checker). The long variant, with etcd's faults too, is
tests/faults/test_history_faults.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc
import pytest

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2_grpc
from tests.factories import d_params, lease_request, node_request
from tests.history.checker import Rule, check
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
from tests.history.workload import TOKENS, Shape, running

PAUSE_S = min(longest_ttl_s() + 2.0, 20.0)
"""The stopped replica's pause: past every TTL (capped: the variant must stay short)."""


@pytest.mark.timeout(150)
async def test_single_use_under_replica_faults(etcd_endpoint: str, tmp_path: Path) -> None:
    recorder = Recorder()
    daemons = await start_replicas(tmp_path, (etcd_endpoint,), f"/hist-{uuid.uuid4().hex[:8]}", 3)
    try:
        shape = Shape(node_restarts_s=1.0)  # (engines restart too: no pull of a dead process's blocks)
        async with running([d.address for d in daemons], shape, recorder):
            await until(recorder, pulled, 20, 0.0)
            await kill_and_restart(recorder, daemons[0])
            # one replica stopped and, meanwhile, another killed: one of three left serving
            await asyncio.gather(pause(recorder, daemons[1], PAUSE_S), kill_and_restart(recorder, daemons[2]))
            await until(recorder, pulled, 20, time.monotonic())
    finally:
        await stop_replicas(daemons)
    report = verdict(recorder, "3 replicas, one etcd: 2 killed, 1 stopped", tmp_path)
    counts = report.counts
    assert counts["handed out by lookup"] >= 40
    assert counts["lookup unknown"] > 0, "no lookup raced its deadline: nothing was put back"
    assert counts["node ok"] >= 4, "engines did not restart"
    judge(report, recorder)


async def test_a_resent_registration_is_found_handed_out_twice(daemon: Daemon) -> None:
    """The recorder and checker find a real double hand-out: a registration sent again
    after its retention was pulled (what sidecar.retentions never does for one that may
    have been stored) puts it back, and the daemon hands it out a second time."""
    recorder, key = Recorder(), ("t1", "c1")
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        await nodes_pb2_grpc.NodesStub(channel).Register(node_request("d-0", generation=1), timeout=5)
        await resend_and_pull(leases_pb2_grpc.LeasesStub(channel), recorder, key)
    [v] = check(recorder.history()).violations
    assert (v.rule, v.retention) == (Rule.TWICE, "x1")
    assert [o.detail for o in v.ops] == ["pull", "pull"]


async def resend_and_pull(
    leases: leases_pb2_grpc.LeasesAsyncStub, recorder: Recorder, key: tuple[str, str]
) -> None:
    """Register retention x1 and pull it, twice."""
    req = lease_request(key[1], "d-0", TOKENS, key[0], params=d_params("d-0", TOKENS, "x1"))
    lookup = leases_pb2.LookupRequest(tenant=key[0], conversation_id=key[1], prompt_tokens=2 * TOKENS)
    for _ in range(2):
        t0 = recorder.start()
        recorder.register("sidecar", key, t0, "x1", await leases.Register(req, timeout=5))
        t0 = recorder.start()
        recorder.lookup("router", key, t0, await leases.Lookup(lookup, timeout=5))

"""A registration that reaches the daemon while etcd stalls (a busy machine, a slow disk),
on a real daemon and a real etcd, paused: the daemon turns it away undecided (ABORTED,
"not applied"), and D's sidecar sends it again until etcd is back, instead of dropping
it as maybe stored and losing the next turn's reuse (the real-vLLM suite lost turn 2 so,
twice, during a 10-17 s stall of the whole machine)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import grpc
import pytest

from kvferry.v1 import leases_pb2
from sidecar.daemon import DaemonLink
from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineFacts, EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.retentions import RetentionSender
from sidecar.settings import DaemonSettings, EngineSettings, RetentionSettings, Settings
from tests.conftest import Client, DaemonFactory, EtcdProcess, daemon_settings, owning
from tests.controlplane.test_owners import Connect
from tests.factories import BLOCK, d_params, lease_request, node_request
from tests.polling import eventually


def _sender(address: str, generation: int) -> tuple[RetentionSender, SidecarMetrics, DaemonLink]:
    daemon = DaemonSettings(
        addresses=(address,), rpc_timeout_s=30.0, backoff_initial_s=0.05, backoff_max_s=0.2
    )
    settings = Settings(
        engine=EngineSettings(engine_id="d-1"),
        daemon=daemon,
        retentions=RetentionSettings(max_attempts=2, retry_pause_max_s=0.2),
    )
    metrics = SidecarMetrics()
    instance = EngineInstance(metrics)
    instance.facts = EngineFacts("test-model", BLOCK)
    instance.set_generation(0, generation)
    link = DaemonLink((address,))
    return RetentionSender(settings, instance, link, metrics), metrics, link


async def _get(c: Client, conversation_id: str) -> leases_pb2.Lease | None:
    try:
        return await c.leases.Get(leases_pb2.GetLeaseRequest(conversation_id=conversation_id), timeout=30)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
        return None


async def test_a_registration_turned_away_while_etcd_stalls_is_sent_again_and_lands(
    private_etcd: EtcdProcess, make_daemon: DaemonFactory, connect: Connect
) -> None:
    # validity ends at most 4 s after the last keep-alive etcd acknowledged; the lease, 10 s
    d = await make_daemon(owning(daemon_settings(private_etcd.endpoint), ttl_s=10, margin_s=6.0))
    assert d.control_plane is not None
    owners = d.control_plane.owners
    c = connect(d)
    node = await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=120))
    sender, metrics, link = _sender(d.address, node.node.generation)
    runner = asyncio.create_task(sender.run())
    try:
        await _stall_then_land(c, private_etcd.etcd.pid, owners.valid, sender, metrics)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await link.close()


async def _stall_then_land(
    c: Client, pid: int, valid: Callable[[], bool], sender: RetentionSender, metrics: SidecarMetrics
) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        await eventually(lambda: not valid(), within=15)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.leases.Register(lease_request("unary"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.ABORTED
        assert "not applied" in (refused.value.details() or "")

        params = d_params("d-1", 64, request_id="turn-1")
        draft = RetentionDraft("", "c", params, 64, time.time() + 300, None, "", 0, request_id="turn-1")
        sender.submit(draft)

        def requeued() -> bool:
            return metrics.value("kvferry_sidecar_lease_registrations_total", outcome="requeue") >= 2

        await eventually(requeued, within=30)  # (tried more often than its attempts allow)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await sender.wait_idle(60)

    def counted(name: str, **labels: str) -> float:
        return metrics.value(f"kvferry_sidecar_lease_registrations{name}_total", **labels)

    assert counted("", outcome="sent") == 1
    assert counted("_dropped", reason="maybe_stored") == counted("_dropped", reason="attempts") == 0
    landed = await _get(c, "c")
    assert landed is not None and landed.request_id == "turn-1" and not landed.claimed
    assert await _get(c, "unary") is None  # (turned away undecided: stored nowhere)

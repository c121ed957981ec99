"""What a failed registration's status proves about the write, and what the sidecar does
then: through a real gRPC server that turns the Leases/Stream away with each status."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvferry.v1 import leases_pb2, leases_pb2_grpc
from sidecar.daemon import DaemonLink
from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineFacts, EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.retentions import RetentionSender, retry_decision
from sidecar.settings import DaemonSettings, RetentionSettings, Settings

Code = grpc.StatusCode
#: What each status proves, when the try reached the daemon (sent) and when it surely did not.
OUTCOMES = {
    # turned away before any write, for good: stored nowhere, D's blocks freed
    Code.INVALID_ARGUMENT: ("failed", "failed"),
    Code.OUT_OF_RANGE: ("failed", "failed"),
    Code.NOT_FOUND: ("failed", "failed"),
    Code.ALREADY_EXISTS: ("failed", "failed"),
    Code.UNAUTHENTICATED: ("failed", "failed"),
    Code.PERMISSION_DENIED: ("failed", "failed"),
    Code.UNIMPLEMENTED: ("failed", "failed"),
    # turned away before any write, for a passing reason: tried again
    Code.FAILED_PRECONDITION: ("retry", "retry"),
    Code.RESOURCE_EXHAUSTED: ("retry", "retry"),
    # turned away undecided while etcd or the conversation's owner could not take it:
    # waits for them as an unanswered try does (test_registration_stall)
    Code.ABORTED: ("requeue", "requeue"),
    # no answer, or a failure that proves nothing: maybe stored once it left
    Code.UNAVAILABLE: ("maybe_stored", "requeue"),
    Code.DEADLINE_EXCEEDED: ("maybe_stored", "requeue"),
    Code.CANCELLED: ("maybe_stored", "requeue"),
    Code.INTERNAL: ("maybe_stored", "retry"),
    Code.UNKNOWN: ("maybe_stored", "retry"),
    Code.DATA_LOSS: ("maybe_stored", "retry"),
}


@pytest.mark.parametrize("code", [c for c in Code if c is not Code.OK], ids=lambda c: c.name)
def test_each_status_is_read_for_what_it_proves(code: grpc.StatusCode) -> None:
    sent, unsent = OUTCOMES[code]
    assert retry_decision(code, 1, 5, sent=True) == sent
    assert retry_decision(code, 1, 5, sent=False) == unsent
    if sent == "retry":  # (bounded by attempts: the fifth try failed)
        assert retry_decision(code, 5, 5, sent=True) == "attempts"
    if unsent == "requeue":  # (waits for the daemon: attempts do not count)
        assert retry_decision(code, 99, 5, sent=False) == "requeue"
    if sent == "requeue":
        assert retry_decision(code, 99, 5, sent=True) == "requeue"


class _Leases(leases_pb2_grpc.LeasesServicer):
    """A replica's Leases/Stream: turned away with `refuse` once its first ops came (as a
    policy check, a decoding guard or an overloaded server ends it), else answering each
    register with success."""

    def __init__(self, refuse: grpc.StatusCode | None) -> None:
        self.refuse = refuse
        self.registered: list[str] = []

    async def Stream(
        self, requests: AsyncIterator[leases_pb2.LeaseOpBatch], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[leases_pb2.LeaseOpResultBatch]:
        async for batch in requests:
            if self.refuse is not None:
                await context.abort(self.refuse, f"turned away: {self.refuse.name}")
            for op in batch.ops:
                self.registered.append(op.register.conversation_id)
                res = leases_pb2.LeaseOpResult(id=op.id, register=leases_pb2.RegisterLeaseResponse())
                yield leases_pb2.LeaseOpResultBatch(results=[res])


class _Releaser:
    in_flight = 0

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(
        self, params: Any, model: str, block_size: int, conversation_id: str, on_done: Any = None
    ) -> None:
        self.released.append(conversation_id)


async def _replica(refuse: grpc.StatusCode | None) -> tuple[grpc.aio.Server, _Leases, str]:
    server = grpc.aio.server()
    leases = _Leases(refuse)  # type: ignore[abstract]  # (only Stream is called)
    leases_pb2_grpc.add_LeasesServicer_to_server(leases, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, leases, f"127.0.0.1:{port}"


async def _register_through(
    *refusals: grpc.StatusCode | None,
) -> tuple[SidecarMetrics, _Releaser, list[_Leases]]:
    """Register one draft through replicas ending each stream with `refusals` (None:
    accepting), until the sender is idle; -> its metrics, its releases, the replicas."""
    replicas = [await _replica(code) for code in refusals]
    addresses = tuple(address for _, _, address in replicas)
    daemon = DaemonSettings(
        addresses=addresses, rpc_timeout_s=10.0, backoff_initial_s=0.01, backoff_max_s=0.01
    )
    settings = Settings(daemon=daemon, retentions=RetentionSettings(max_attempts=3))
    metrics = SidecarMetrics()
    instance = EngineInstance(metrics)
    instance.facts = EngineFacts("m", 16)
    instance.set_generation(0, 1)
    link = DaemonLink(addresses)
    releaser = _Releaser()
    sender = RetentionSender(settings, instance, link, metrics, releaser)  # type: ignore[arg-type]
    params = {
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
    }
    draft = RetentionDraft("acme", "c", params, 32, time.time() + 300, None, "", 0, request_id="r")
    runner = asyncio.create_task(sender.run())
    try:
        sender.submit(draft)
        assert await sender.wait_idle(20)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await link.close()
        for server, _, _ in replicas:
            await server.stop(None)
    return metrics, releaser, [leases for _, leases, _ in replicas]


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (Code.INVALID_ARGUMENT, "refused"),
        (Code.PERMISSION_DENIED, "refused"),
        (Code.UNAUTHENTICATED, "refused"),
        (Code.RESOURCE_EXHAUSTED, "retried"),
        (Code.FAILED_PRECONDITION, "retried"),
        (Code.UNAVAILABLE, "maybe_stored"),
        (Code.INTERNAL, "maybe_stored"),
    ],
    ids=lambda v: v.name if isinstance(v, grpc.StatusCode) else v,
)
async def test_a_stream_turned_away_is_read_for_what_its_status_proves(
    code: grpc.StatusCode, outcome: str
) -> None:
    """The first replica ends the stream with `code` once the registration reached it; the
    second accepts. Every stream-ending status was read as UNAVAILABLE, so "maybe stored":
    dropped, though the status proved nothing written. Now a refusal is counted as one and
    D told to free the blocks, a passing one is tried again on the next replica, and only
    what may have been stored is dropped as before."""
    metrics, releaser, (refusing, accepting) = await _register_through(code, None)

    def registrations(outcome: str) -> float:
        return metrics.value("kvferry_sidecar_lease_registrations_total", outcome=outcome)

    def dropped(reason: str) -> float:
        return metrics.value("kvferry_sidecar_lease_registrations_dropped_total", reason=reason)

    assert refusing.registered == []  # (turned away before the handler read it)
    if outcome == "refused":
        assert (registrations("failed"), releaser.released, accepting.registered) == (1, ["c"], [])
    elif outcome == "retried":
        assert (registrations("retry"), registrations("sent"), accepting.registered) == (1, 1, ["c"])
        assert releaser.released == []
    else:
        assert (dropped("maybe_stored"), releaser.released, accepting.registered) == (1, [], [])
    if outcome != "maybe_stored":
        assert dropped("maybe_stored") == 0


async def test_a_registration_turned_away_unwritten_every_time_frees_ds_blocks() -> None:
    """Tried enough, each try turned away before any write (else it would have been dropped
    as maybe stored at once): stored nowhere, so D is told to free its blocks."""
    metrics, releaser, replicas = await _register_through(Code.RESOURCE_EXHAUSTED, Code.RESOURCE_EXHAUSTED)
    assert metrics.value("kvferry_sidecar_lease_registrations_dropped_total", reason="attempts") == 1
    assert releaser.released == ["c"] and [r.registered for r in replicas] == [[], []]

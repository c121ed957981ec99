"""The sender and its orphan book: a maybe-stored draft a later registration resolves, drafts
left at shutdown, and releases that wait for room in the releaser. Through a real gRPC
server standing in for the daemon's Leases/Stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvferry.structs import dict_to_struct
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from sidecar.daemon import DaemonLink
from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineFacts, EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.orphanrelease import ORPHAN_ROOM
from sidecar.retentions import RetentionSender
from sidecar.settings import DaemonSettings, RetentionSettings, Settings
from tests.polling import eventually

ORPHANS = "kvferry_sidecar_orphans_total"
BLOCKS = "kvferry_sidecar_orphan_blocks"


def _params(rid: str) -> dict[str, Any]:
    return {"remote_engine_id": "d", "remote_request_id": rid, "remote_host": "10.0.0.2", "remote_port": 5600}


def _draft(rid: str, conv: str = "c", tokens: int = 64) -> RetentionDraft:
    return RetentionDraft("acme", conv, _params(rid), tokens, time.time() + 300, None, "", 0, request_id=rid)


class _Leases(leases_pb2_grpc.LeasesServicer):
    """A replica's Leases/Stream: the first register op ends the stream with INTERNAL once it
    came (an answer that proves nothing: maybe stored); later ones are answered, handing back
    the params of the conversation's previous registration as the daemon does for a
    retention it replaced unclaimed."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, Any]] = {}
        self.failed_once = False

    async def Stream(
        self, requests: AsyncIterator[leases_pb2.LeaseOpBatch], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[leases_pb2.LeaseOpResultBatch]:
        async for batch in requests:
            for op in batch.ops:
                reg = op.register
                previous = self.seen.get(reg.conversation_id)
                self.seen[reg.conversation_id] = {
                    **{k: v for k, v in _params("").items() if k != "remote_request_id"},
                    "remote_request_id": reg.request_id,
                }
                if not self.failed_once:
                    self.failed_once = True
                    await context.abort(grpc.StatusCode.INTERNAL, "the write's fate is unknown")
                res = leases_pb2.RegisterLeaseResponse(replaced=previous is not None)
                if previous is not None:
                    dict_to_struct({**previous, "remote_num_tokens": 0}, res.release_params)
                result = leases_pb2.LeaseOpResult(id=op.id, register=res)
                yield leases_pb2.LeaseOpResultBatch(results=[result])


class _Releaser:
    """Records each release; `outcome` is what each ends with, told at once."""

    def __init__(self, outcome: str = "released") -> None:
        self.in_flight = 0
        self.outcome = outcome
        self.released: list[str] = []

    def release(
        self, params: Any, model: str, block_size: int, conversation_id: str, on_done: Any = None
    ) -> None:
        self.released.append(params["remote_request_id"])
        if on_done is not None:
            on_done(self.outcome)


def _sender(
    address: str, releaser: _Releaser, queue_size: int = 16
) -> tuple[RetentionSender, SidecarMetrics]:
    daemon = DaemonSettings(
        addresses=(address,), rpc_timeout_s=10.0, backoff_initial_s=0.01, backoff_max_s=0.01
    )
    settings = Settings(daemon=daemon, retentions=RetentionSettings(queue_size=queue_size))
    metrics = SidecarMetrics()
    instance = EngineInstance(metrics)
    instance.facts = EngineFacts("m", 16)
    instance.set_generation(0, 1)
    sender = RetentionSender(settings, instance, DaemonLink((address,)), metrics, releaser)  # type: ignore[arg-type]
    return sender, metrics


async def test_a_maybe_stored_draft_is_counted_until_a_later_registration_hands_it_back() -> None:
    server = grpc.aio.server()
    leases_pb2_grpc.add_LeasesServicer_to_server(_Leases(), server)  # type: ignore[abstract]
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    releaser = _Releaser()
    sender, metrics = _sender(address, releaser)
    runner = asyncio.create_task(sender.run())
    try:
        sender.submit(_draft("r1"))
        assert await sender.wait_idle(10)
        assert metrics.value(ORPHANS, reason="maybe_stored", action="counted") == 1
        assert metrics.value(BLOCKS, reason="maybe_stored") == 4 and releaser.released == []

        sender.submit(_draft("r2"))  # the next turn: the daemon had stored r1, and hands it back
        assert await sender.wait_idle(10)
        assert releaser.released == ["r1"]
        assert metrics.value(ORPHANS, reason="maybe_stored", action="resolved") == 1
        assert metrics.value(BLOCKS, reason="maybe_stored") == 0
        assert metrics.value("kvferry_sidecar_releases_total", reason="replaced") == 1
        assert metrics.value("kvferry_sidecar_releases_total", reason="orphan") == 0
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await server.stop(None)


async def test_drafts_left_at_shutdown_are_released() -> None:
    """Queued, never sent (the node never registered): stored nowhere, so D frees them."""
    releaser = _Releaser()
    sender, metrics = _sender("127.0.0.1:9", releaser)
    sender.submit(_draft("a", "c1"))
    sender.submit(_draft("b", "c2"))
    assert sender.abandon() == 2
    assert releaser.released == ["a", "b"]
    assert metrics.value(ORPHANS, reason="shutdown", action="released") == 2
    assert metrics.value("kvferry_sidecar_releases_total", reason="orphan") == 2


async def test_releases_wait_for_room_in_the_releaser_and_go_when_there_is() -> None:
    """A queue overflowing while the releaser is busy: the release waits (its blocks shown),
    and the periodic pass sends it once the releaser has room."""
    releaser = _Releaser()
    releaser.in_flight = ORPHAN_ROOM
    sender, metrics = _sender("127.0.0.1:9", releaser, queue_size=1)
    runner = asyncio.create_task(sender.run())  # (the node never registers: nothing is sent)
    try:
        sender.submit(_draft("a", "c1"))
        sender.submit(_draft("b", "c2"))  # pushes "a" out
        assert releaser.released == [] and metrics.value(BLOCKS, reason="overflow") == 4
        releaser.in_flight = 0

        async def sent() -> bool:
            return releaser.released == ["a"]

        await eventually(sent, within=10)
        assert metrics.value(BLOCKS, reason="overflow") == 0
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_a_release_that_did_not_take_is_tried_again_then_counted() -> None:
    """No P known yet (the daemon away): the release waits and goes again on the periodic
    pass; a P that answers it with an error leaves the blocks counted until D's TTL."""
    releaser = _Releaser("no_prefill")
    sender, metrics = _sender("127.0.0.1:9", releaser)
    runner = asyncio.create_task(sender.run())
    try:
        sender.submit(_draft("a", "c1"))
        sender.abandon()  # ("a" was queued: stored nowhere)
        assert releaser.released == ["a"] and metrics.value(BLOCKS, reason="shutdown") == 4
        releaser.outcome = "refused"

        async def tried_again() -> bool:
            return releaser.released == ["a", "a"]

        await eventually(tried_again, within=10)
        assert metrics.value(BLOCKS, reason="shutdown") == 4  # (D still holds them: shown)
        assert sender.orphans.unretained.orphans.waiting == 0
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

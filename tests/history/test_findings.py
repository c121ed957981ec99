"""What the history check found in the daemon, each made to happen on purpose: real
daemon processes, real etcd, the recorded history checked as in test_history.py."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import grpc
import pytest

from kvferry.v1 import leases_pb2, leases_pb2_grpc
from tests.factories import d_params, lease_request
from tests.faults.cluster import DaemonProcess
from tests.history.checker import Kind, check
from tests.history.harness import start_replicas, stop_replicas
from tests.history.recorder import Recorder
from tests.history.workload import CHANNEL_OPTIONS, TOKENS, FakeSidecar, Shape, Shared
from tests.polling import eventually

KEY = ("t1", "c0")
"""The conversation (of engine d-0, the fake sidecar's)."""


@pytest.mark.timeout(120)
async def test_a_put_back_does_not_undo_a_newer_registration(etcd_endpoint: str, tmp_path: Path) -> None:
    """A lookup on replica A claims X and its caller goes away while A is stopped (its
    put-back waits for A); meanwhile X's conversation registers Y through replica B, and
    B's budget releases Y. Once A runs again, X must not come back: Y replaced it.
    (Found by the history check: the budget's release, RetentionStore.revoke_exact, left
    X's claim marker, which is all a put-back compares; it now takes the marker too.)"""
    recorder = Recorder()
    a, b = await start_replicas(tmp_path, (etcd_endpoint,), f"/find-{uuid.uuid4().hex[:8]}", 2)
    channels = [grpc.aio.insecure_channel(d.address, options=CHANNEL_OPTIONS) for d in (a, b)]
    # The fake sidecar attaches to B only, with a pool whose budget holds no retention.
    shared = Shared([b.address], recorder, Shape(engines=1, pool_blocks=100), channels[1:])
    sidecar = FakeSidecar(shared, 0)  # (its replica "r0" is B)
    attaching = asyncio.create_task(sidecar.attach_forever())
    on_a, on_b = (leases_pb2_grpc.LeasesStub(ch) for ch in channels)
    try:
        await asyncio.wait_for(sidecar.attached.wait(), 30)
        await register(recorder, on_a, "x1", "A")  # (through A: B's budget never knows it)
        claiming = on_a.Stream()  # type: ignore[call-arg]  # (written to, not iterated)
        lookup = leases_pb2.LookupRequest(tenant=KEY[0], conversation_id=KEY[1], prompt_follows=True)
        t0 = recorder.start()
        await claiming.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=lookup)]))
        await eventually(lambda: claimed(on_b), within=30)  # A claimed x1, waits for the prompt
        a.signal(signal.SIGSTOP)
        try:
            claiming.cancel()  # the caller goes away: A puts x1 back once it runs
            recorder.failed(Kind.LOOKUP, "router", KEY, t0, asyncio.CancelledError(), "A")
            # replaces x1 (claimed: nothing to release); while A owns the shard and is
            # stopped, B's forward goes unanswered until A's ownership lapses (--owner-ttl)
            await register_until_taken(recorder, on_b, "x2", "B")
            async with asyncio.timeout(30):  # B's budget releases x2
                await recorder.until(lambda o: o.kind is Kind.RELEASE and o.handed == "x2", 1, 0.0)
        finally:
            a.signal(signal.SIGCONT)
        await eventually(lambda: put_back_logged(a), within=30)  # (back or not)
        t0 = recorder.start()
        req = leases_pb2.LookupRequest(tenant=KEY[0], conversation_id=KEY[1], prompt_tokens=2 * TOKENS)
        recorder.lookup("router", KEY, t0, await on_b.Lookup(req, timeout=10), "B")
    finally:
        shared.stopping.set()
        attaching.cancel()
        await asyncio.gather(attaching, return_exceptions=True)
        await sidecar.close()
        for ch in channels:
            await ch.close(None)
        await stop_replicas([a, b])
    report = check(recorder.history())
    history = recorder.excerpt_lines(tuple(recorder.history()))
    assert report.ok, "\n".join(
        [*(f"{v.rule}: {v.retention}: {v.text}" for v in report.violations), *history]
    )


async def register(recorder: Recorder, leases: leases_pb2_grpc.LeasesAsyncStub, x: str, via: str) -> None:
    req = lease_request(KEY[1], "d-0", TOKENS, KEY[0], params=d_params("d-0", TOKENS, x))
    t0 = recorder.start()
    recorder.register("d-0/reg", KEY, t0, x, await leases.Register(req, timeout=10), via)


async def claimed(leases: leases_pb2_grpc.LeasesAsyncStub) -> bool:
    got = await leases.Get(leases_pb2.GetLeaseRequest(tenant=KEY[0], conversation_id=KEY[1]), timeout=5)
    return got.claimed


async def put_back_logged(d: DaemonProcess) -> bool:
    """Whether replica `d` logged its try to put a claim back (whatever came of it: given up
    too, when the shard's new owner did not answer)."""
    text = d.log_path.read_text(errors="replace")
    return '"lookup.put_back"' in text or '"lookup.put_back.failed"' in text


async def register_until_taken(
    recorder: Recorder, leases: leases_pb2_grpc.LeasesAsyncStub, x: str, via: str, within_s: float = 60.0
) -> None:
    """`register`, again while the shard's owner does not answer (each try recorded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        req = lease_request(KEY[1], "d-0", TOKENS, KEY[0], params=d_params("d-0", TOKENS, x))
        t0 = recorder.start()
        try:
            res = await leases.Register(req, timeout=10)
        except grpc.aio.AioRpcError as e:
            recorder.failed(Kind.REGISTER, "d-0/reg", KEY, t0, e, via, retention=x)
            again = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
            if not again or loop.time() > deadline:
                raise
            continue
        recorder.register("d-0/reg", KEY, t0, x, res, via)
        return

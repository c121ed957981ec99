"""The GC lease table (controlplane.store.gcleases.GcLeases) against a fake etcd whose grants the
test releases: one grant per bucket however many callers, and a cancelled caller does
not fail the others waiting for the same grant."""

from __future__ import annotations

import asyncio

import pytest
from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.store.gcleases import GcLeases


class FakeLeases:
    """`leasestub.LeaseGrant` answered when the test says so."""

    def __init__(self) -> None:
        self.leasestub = self
        self.grants: list[asyncio.Future[rpc.LeaseGrantResponse]] = []

    def LeaseGrant(
        self, req: rpc.LeaseGrantRequest, timeout: float
    ) -> asyncio.Future[rpc.LeaseGrantResponse]:
        fut: asyncio.Future[rpc.LeaseGrantResponse] = asyncio.get_running_loop().create_future()
        self.grants.append(fut)
        return fut


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_callers_share_one_grant() -> None:
    etcd = FakeLeases()
    gc = GcLeases(etcd, bucket_s=60, max_keys=100, timeout=1.0)  # type: ignore[arg-type]
    callers = [asyncio.create_task(gc.lease_for(1000.0, 0.0)) for _ in range(5)]
    await settle()
    assert len(etcd.grants) == 1
    etcd.grants[0].set_result(rpc.LeaseGrantResponse(ID=7, TTL=60))
    assert await asyncio.gather(*callers) == [7] * 5


async def test_a_cancelled_granter_does_not_fail_the_waiters() -> None:
    etcd = FakeLeases()
    gc = GcLeases(etcd, bucket_s=60, max_keys=100, timeout=1.0)  # type: ignore[arg-type]
    granter = asyncio.create_task(gc.lease_for(1000.0, 0.0))
    await settle()
    waiter = asyncio.create_task(gc.lease_for(1000.0, 0.0))
    await settle()
    granter.cancel()  # e.g. its client's deadline passed
    await settle()
    assert granter.cancelled() and not waiter.done()
    assert len(etcd.grants) == 2  # the waiter asks itself
    etcd.grants[1].set_result(rpc.LeaseGrantResponse(ID=9, TTL=60))
    assert await waiter == 9


async def test_a_failed_grant_fails_its_waiters_at_once() -> None:
    etcd = FakeLeases()
    gc = GcLeases(etcd, bucket_s=60, max_keys=100, timeout=1.0)  # type: ignore[arg-type]
    callers = [asyncio.create_task(gc.lease_for(1000.0, 0.0)) for _ in range(3)]
    await settle()
    etcd.grants[0].set_exception(ConnectionError("etcd down"))
    for c in callers:
        with pytest.raises(StoreUnavailable):
            await c
    assert len(etcd.grants) == 1

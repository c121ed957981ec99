"""A registration's once-only mark in etcd: kept for the resend window, not for the
retention's life (an etcd key per registration for 480 s would double the store)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from aetcd import rpc

from controlplane.records import Keys, Registered, Retention
from controlplane.store import MARK_BUCKET_S, REGISTRATION_MARK_S, EtcdStore

BUCKET_S = 60


@pytest.fixture
async def store(etcd_endpoint: str) -> AsyncIterator[EtcdStore]:
    s = EtcdStore((etcd_endpoint,), Keys(f"/t-{uuid.uuid4().hex[:10]}"), 2.0, BUCKET_S, 10_000, 600)
    await s.connect()
    await s.ready(10)
    yield s
    await s.close()


async def _lease_ttl(store: EtcdStore, key: bytes) -> int:
    [kv] = (await store._client.kvstub.Range(rpc.RangeRequest(key=key))).kvs
    ttl = await store._client.leasestub.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=kv.lease))
    return int(ttl.TTL)


async def test_a_mark_is_kept_for_the_window_on_a_lease_of_its_own(store: EtcdStore) -> None:
    now = time.time()
    r = Retention(
        engine_id="d-1", generation=1, params=b"", num_tokens=100, block_size=16,
        created_at=now, expires_at=now + 480,
    )  # fmt: skip
    assert (await store.put_retention("t", "c", r, "req-9", now))[1] is Registered.NEW
    assert (await store.put_retention("t", "c", r, "req-9", now))[1] is Registered.DUPLICATE
    assert (await store.put_retention("t", "c", r, "req-10", now))[1] is Registered.REPLACED

    mark = await _lease_ttl(store, store.keys.registration("d-1", "req-9"))
    retention = await _lease_ttl(store, store.keys.retention("t", "c"))
    assert REGISTRATION_MARK_S <= mark <= REGISTRATION_MARK_S + 2 * MARK_BUCKET_S
    assert retention >= 480 > mark

"""The gauge scan reads etcd in bounded windows and still sees every retention.

etcd 3.5 counts a range to its end even with a limit, so paging through the
whole retention prefix costs O(all retentions) per page and stalls writes; the
scan instead reads windows split at keys remembered from its previous pass (or
sampled at registration). These tests pin what must not change: every live
retention is counted exactly once, whatever the remembered bounds are."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import structlog
from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.etcd import LeaseGone
from controlplane.records import (
    NodeRecord,
    Retention,
    Role,
    decode_bounds,
    encode_bounds,
    prefix_end,
)
from controlplane.store import EtcdStore
from controlplane.store import scans as scans_mod


def retention(engine: str, tokens: int) -> Retention:
    now = time.time()
    return Retention(
        engine_id=engine, generation=1, params=b"", num_tokens=tokens, block_size=16,
        created_at=now, expires_at=now + 300,
    )  # fmt: skip


async def held(s: EtcdStore) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    async for scanned in s.scans.scan_held(pause_s=0):
        r = scanned.held
        n, t = out.get(r.engine_id, (0, 0))
        out[r.engine_id] = (n + 1, t + r.num_tokens)
    return out


async def stored_bounds(s: EtcdStore) -> list[bytes]:
    resp = await s._client.kvstub.Range(rpc.RangeRequest(key=s.keys.scan_bounds))
    return decode_bounds(resp.kvs[0].value) if resp.kvs else []


async def scanned(store: EtcdStore, monkeypatch: pytest.MonkeyPatch, page: int, n: int) -> float:
    """`n` one-token retentions on d-a (tenant "t", c000...), a scan with window bounds
    every `page`-th key done. -> the time they were registered at."""
    monkeypatch.setattr(scans_mod, "SCAN_PAGE", page)
    now = time.time()
    for i in range(n):
        await store.retentions.put("t", f"c{i:03d}", retention("d-a", 1), now)
    assert await held(store) == {"d-a": (n, n)}
    return now


@contextlib.asynccontextmanager
async def replica(store: EtcdStore, etcd_endpoint: str) -> AsyncIterator[tuple[EtcdStore, list[bytes]]]:
    """A second store on the same keys (another daemon replica), and the end key of each
    page request it sends (a limited range; reading the bounds themselves is a plain get)."""
    other = EtcdStore((etcd_endpoint,), store.keys, 2.0, 60, 10_000, 600)
    await other.connect()
    ends: list[bytes] = []
    real = other._client.kvstub.Range

    def recording(req, **kw):  # type: ignore[no-untyped-def]
        if req.limit:
            ends.append(req.range_end)
        return real(req, **kw)

    other._client.kvstub.Range = recording
    try:
        yield other, ends
    finally:
        await other.close()


async def test_every_retention_once_with_sampled_then_remembered_bounds(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scans_mod, "SCAN_PAGE", 7)
    now = time.time()
    for i in range(60):
        await store.retentions.put("t", f"c{i:03d}", retention("d-a" if i % 3 else "d-b", 100), now)
    expected = {"d-a": (40, 4000), "d-b": (20, 2000)}
    assert len(store.scans._sampled) == 60 // 7  # every 7th registration: a window bound
    assert await held(store) == expected
    bounds = await stored_bounds(store)
    assert len(bounds) == 60 // 7 and bounds == sorted(bounds)  # every 7th key seen
    # Churn between passes: a remembered bound's key is gone, new keys land around them.
    for i in range(0, 60, 5):
        await store.retentions.claim("t", f"c{i:03d}", now)
    for i in range(60, 75):
        await store.retentions.put("t", f"c{i:03d}", retention("d-b", 10), now)
    assert await held(store) == {"d-a": (32, 3200), "d-b": (31, 1750)}


async def test_a_new_replica_reads_windows_from_the_bounds_kept_in_etcd(
    store: EtcdStore, etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await scanned(store, monkeypatch, 5, 40)
    bounds = await stored_bounds(store)
    async with replica(store, etcd_endpoint) as (other, ends):
        assert await held(other) == {"d-a": (40, 40)}
    # Each request ends at a remembered bound (or the prefix's end): O(window), not O(all).
    assert set(ends) == {*bounds, prefix_end(store.keys.retentions)}


async def test_bad_bounds_in_etcd_are_ignored_with_a_log_line(store: EtcdStore) -> None:
    now = time.time()
    for i in range(20):
        await store.retentions.put("t", f"c{i}", retention("d-a", 1), now)
    outside = [store.keys.retentions[:-1], b"\xff"]  # not inside the prefix
    for value in (b"not json", encode_bounds(outside), encode_bounds([store.keys.retention("t", "c5")] * 2)):
        await store._client.kvstub.Put(rpc.PutRequest(key=store.keys.scan_bounds, value=value))
        with structlog.testing.capture_logs() as logs:
            assert await held(store) == {"d-a": (20, 20)}
        assert [e["event"] for e in logs] == ["scan_bounds.invalid"]


async def listed(s: EtcdStore, prefix: bytes, limit: int) -> list[str]:
    out: list[str] = []
    start = b""
    while True:
        page, start = await s.scans.page(prefix, start, limit)
        assert len(page) <= limit
        out.extend(f"{r.tenant}/{r.conversation_id}" for r in page)
        if not start:
            return out


@pytest.mark.parametrize("limit", [1, 3, 7, 100])
async def test_listing_pages_through_the_windows_and_sees_every_retention_once(
    store: EtcdStore, etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    monkeypatch.setattr(scans_mod, "SCAN_PAGE", 4)
    now = time.time()
    for i in range(30):
        await store.retentions.put("a" if i % 2 else "b", f"c{i:03d}", retention("d-a", 1), now)
    assert await held(store) == {"d-a": (30, 30)}  # a scan: window bounds every 4th key
    bounds = await stored_bounds(store)
    assert len(bounds) == 7
    every = sorted(f"{'a' if i % 2 else 'b'}/c{i:03d}" for i in range(30))
    # A replica that never scanned reads the bounds from etcd.
    async with replica(store, etcd_endpoint) as (other, ends):
        assert await listed(other, store.keys.retentions, limit) == every
        assert await listed(other, store.keys.tenant_retentions("a"), limit) == [
            x for x in every if x[0] == "a"
        ]
    # Every request stops at a bound (or a listed prefix's end), never at the end of all keys.
    allowed = {*bounds, prefix_end(store.keys.retentions), prefix_end(store.keys.tenant_retentions("a"))}
    assert set(ends) <= allowed and len(set(ends) & set(bounds)) > 1


async def test_a_listing_is_not_disturbed_by_keys_sampled_while_it_runs(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing keeps the window bounds it started with: another listing merging keys
    registered meanwhile must not shift them under it (that repeated keys)."""
    now = await scanned(store, monkeypatch, 4, 40)
    gate, waiting, calls = asyncio.Event(), asyncio.Event(), 0
    real = store._client.kvstub.Range

    async def gated(req, **kw):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 2:  # the first listing, between two windows
            waiting.set()
            await gate.wait()
        return await real(req, **kw)

    store._client.kvstub.Range = gated
    first = asyncio.create_task(listed(store, store.keys.retentions, 1000))
    await waiting.wait()
    for i in range(12):  # keys sampled below where the first listing stands
        await store.retentions.put("t", f"a{i:03d}", retention("d-a", 1), now)
    assert len(await listed(store, store.keys.retentions, 1000)) == 52
    gate.set()
    keys = await first
    assert len(keys) == len(set(keys)) and {f"t/c{i:03d}" for i in range(40)} <= set(keys)


async def test_stale_bounds_over_an_emptied_store_cost_few_requests(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await scanned(store, monkeypatch, 2, 200)
    for i in range(199):
        await store.retentions.revoke("t", f"c{i:03d}")
    ranges = 0
    real = store._client.kvstub.Range

    def counting(req, **kw):  # type: ignore[no-untyped-def]
        nonlocal ranges
        ranges += 1
        return real(req, **kw)

    store._client.kvstub.Range = counting
    assert await listed(store, store.keys.retentions, 100) == ["t/c199"]
    assert ranges <= 12  # 99 windows, skipped in doubling spans


async def test_a_record_this_version_cannot_read_is_skipped_with_a_log_line(store: EtcdStore) -> None:
    """A record written by another version of kvferry (a field of a type this one does not
    read): a listing, the gauge scan and the node cache skip it. One such record failed a
    whole listing and stopped the node cache's refresh loop for good."""
    now = time.time()
    for i in range(3):
        await store.retentions.put("t", f"c{i}", retention("d-a", 1), now)
    garbled = b'{"engine_id": 7}'
    await store._client.kvstub.Put(rpc.PutRequest(key=store.keys.retention("t", "c1x"), value=garbled))
    await store._client.kvstub.Put(rpc.PutRequest(key=store.keys.node("d-new"), value=garbled))
    with structlog.testing.capture_logs() as logs:
        assert await listed(store, store.keys.retentions, 10) == ["t/c0", "t/c1", "t/c2"]
        assert await held(store) == {"d-a": (3, 3)}
        states, _ = await store.nodes.load()
        assert "d-new" not in states
        assert await store.nodes.get("d-new") == (None, 0)
    assert {e["event"] for e in logs} == {"etcd.record.undecodable"}


async def test_a_claim_of_a_record_this_version_cannot_read_takes_nothing(store: EtcdStore) -> None:
    """Claimed, a retention another version wrote is gone all the same: the lookup takes
    nothing (RECOMPUTE), not an INTERNAL error. An unreadable claim marker still says the
    conversation was handed out; an unreadable liveness key leaves its node not alive, and
    the other nodes load."""
    now = time.time()
    put = store._client.kvstub.Put
    await put(rpc.PutRequest(key=store.keys.retention("t", "odd"), value=b'{"engine_id": 7}'))
    with structlog.testing.capture_logs() as logs:
        outcome = await store.retentions.claim("t", "odd", now)
    assert outcome.taken is None and outcome.earlier is None
    assert [e["event"] for e in logs] == ["etcd.record.undecodable"]
    again = await store.retentions.claim("t", "odd", now + 1)  # the marker this claim left
    assert again.taken is None and again.earlier is not None

    await put(rpc.PutRequest(key=store.keys.claim("t", "marked"), value=b"[]"))
    marked = await store.retentions.claim("t", "marked", now)
    assert marked.taken is None and marked.earlier is not None and marked.earlier.claimed_at == now

    for engine in ("d-a", "d-b"):
        rec = NodeRecord(engine, Role.DECODE, "m", 16, "http://d", "10.0.0.7", 5600, 1, now, 30)
        await store.nodes.put(rec, 0)
    await put(rpc.PutRequest(key=store.keys.alive_key("d-a"), value=b"not-a-generation"))
    with structlog.testing.capture_logs() as logs:
        states, _ = await store.nodes.load()
    assert not states["d-a"].alive and states["d-b"].alive
    assert [e["event"] for e in logs] == ["etcd.record.undecodable"]


async def test_a_liveness_lease_gone_before_its_write_is_store_unavailable(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd slow enough that a node's new liveness lease expired before the write naming it:
    UNAVAILABLE to the sidecar (which registers again), not an INTERNAL error."""

    async def lease_gone(*args: object, **kwargs: object) -> None:
        raise LeaseGone("etcdserver: requested lease not found")

    monkeypatch.setattr(store.kv, "txn", lease_gone)
    rec = NodeRecord("d-s", Role.DECODE, "m", 16, "http://d", "10.0.0.7", 5600, 1, time.time(), 2)
    with pytest.raises(StoreUnavailable, match="liveness lease of d-s"):
        await store.nodes.put(rec, 0)

"""A node's liveness ends on the wall clock, not only with its etcd lease: etcd renews every
lease's whole TTL when it restarts (the embedded one restarts with the daemon), so a node
registered by hand for 10 minutes stayed alive 30 minutes across daemon restarts."""

from __future__ import annotations

import asyncio
import time

import grpc

from controlplane.records import NodeRecord, Role
from controlplane.store import EtcdStore
from kvferry.v1 import nodes_pb2
from tests.conftest import Client, DaemonFactory, EtcdProcess, daemon_settings
from tests.factories import node_request


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _node(ttl: int) -> NodeRecord:
    return NodeRecord("d-1", Role.DECODE, "m", 16, "http://d", "10.0.0.7", 5600, 1, time.time(), ttl)


async def _alive(store: EtcdStore) -> bool:
    state, _ = await store.nodes.get("d-1")
    assert state is not None
    return state.alive


async def test_a_liveness_ends_a_ttl_after_the_last_write_whatever_the_lease_says(store: EtcdStore) -> None:
    clock = Clock()
    store.nodes._clock = clock
    await store.nodes.put(_node(ttl=600), 0)
    assert await _alive(store)
    clock.now += 599
    assert await _alive(store)
    clock.now += 2  # (the etcd lease itself has 600 s left: as after an etcd restart)
    assert not await _alive(store)
    states, _ = await store.nodes.load()
    assert not states["d-1"].alive


async def test_heartbeats_move_the_end_ahead_every_half_ttl(store: EtcdStore) -> None:
    clock = Clock()
    store.nodes._clock = clock
    rec, _ = await store.nodes.put(_node(ttl=600), 0)
    writes = 0
    for _ in range(6):  # a heartbeat every third of the TTL, for two TTLs
        clock.now += 200
        before = (await store.kv.read("test", _alive_key(store)))[0].kvs[0].mod_revision
        ttl, rec = await store.nodes.keepalive(rec)
        after = (await store.kv.read("test", _alive_key(store)))[0].kvs[0].mod_revision
        writes += after != before
        assert ttl > 0 and await _alive(store)
    assert writes == 3  # every other heartbeat writes


def _alive_key(store: EtcdStore):  # type: ignore[no-untyped-def]
    from controlplane.store.kv import get

    return get(store.keys.alive_key("d-1"))


async def test_a_suspended_node_is_not_brought_back_by_a_late_heartbeat(store: EtcdStore) -> None:
    clock = Clock()
    store.nodes._clock = clock
    rec, _ = await store.nodes.put(_node(ttl=600), 0)
    assert await store.nodes.suspend(rec, clock.now) is not None
    clock.now += 400  # (past half the TTL: a heartbeat would write the key)
    await store.nodes._extend(rec, clock.now)
    assert (await store.kv.read("test", _alive_key(store)))[0].kvs == []


async def test_a_liveness_ends_on_time_across_an_etcd_restart(
    private_etcd: EtcdProcess, make_daemon: DaemonFactory, connect
) -> None:  # type: ignore[no-untyped-def]
    ttl = 5
    d = await make_daemon(daemon_settings(private_etcd.endpoint))
    c: Client = connect(d)
    await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=ttl))
    registered = time.time()
    await private_etcd.stop()
    await asyncio.sleep(max(0.0, registered + ttl + 0.5 - time.time()))  # its end passes, etcd down
    await private_etcd.start()  # etcd gives the lease its whole TTL again
    listed = None
    for _ in range(200):  # until the daemon has reconnected
        try:
            listed = await c.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True), timeout=10)
            break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.05)
    assert listed is not None
    [node] = [n for n in listed.nodes if n.engine_id == "d-1"]
    assert not node.alive

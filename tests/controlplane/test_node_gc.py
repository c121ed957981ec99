"""Records of long-dead nodes are deleted, and that never lets an old retention match a
new engine process: the generation floor, raised in the same etcd transaction as each
deletion, keeps every later generation of a fresh record above the deleted ones."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from controlplane.daemon import Daemon
from controlplane.settings import NodeSettings
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually


async def gc_daemon(make_daemon: DaemonFactory, etcd_endpoint: str, gc_after_s: float) -> Daemon:
    s = daemon_settings(etcd_endpoint)
    nodes = NodeSettings(liveness_ttl_s=10, cache_refresh_s=0.2, gc_after_s=gc_after_s)
    d: Daemon = await make_daemon(replace(s, nodes=nodes))
    return d


async def listed(c: Client) -> set[str]:
    resp = await c.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))
    return {n.engine_id for n in resp.nodes}


async def wait_collected(d: Daemon, engine_id: str, polls: int = 100) -> None:
    assert d.control_plane is not None
    for _ in range(polls):  # 10 s
        if (await d.control_plane.store.nodes.get(engine_id))[0] is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{engine_id} was not collected")


async def test_deregistered_node_is_collected_and_comes_back_above_it(
    make_daemon: DaemonFactory, connect, etcd_endpoint: str
) -> None:  # type: ignore[no-untyped-def]
    d = await gc_daemon(make_daemon, etcd_endpoint, gc_after_s=1.0)
    c: Client = connect(d)
    await c.nodes.Register(node_request("d-1"))
    await c.nodes.Register(node_request("d-1"))  # a restart: generation 2
    await c.leases.Register(lease_request("old"))
    await c.nodes.Register(node_request("d-2", liveness_ttl_seconds=60))
    await c.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d-1"))
    await wait_collected(d, "d-1")
    assert await listed(c) == {"d-2"}  # the live one stays
    # The same engine id, a new process: above every collected generation.
    back = await c.nodes.Register(node_request("d-1"))
    assert back.node.generation == 3
    old = await c.leases.Lookup(lookup_request("old"))
    assert old.decision == leases_pb2.RECOMPUTE and old.reason == "node_restarted"
    # Any engine id new to the store starts above the floor too.
    assert (await c.nodes.Register(node_request("d-9"))).node.generation == 3


async def test_lapsed_node_is_collected_and_its_own_process_may_return(
    make_daemon: DaemonFactory, connect, etcd_endpoint: str
) -> None:  # type: ignore[no-untyped-def]
    d = await gc_daemon(make_daemon, etcd_endpoint, gc_after_s=0.5)
    c: Client = connect(d)
    first = await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=2))
    await c.leases.Register(lease_request("held"))
    await wait_collected(d, "d-1")  # no Attach: liveness lapses after 2 s, then 0.5 s more
    # The sidecar of the same engine process comes back with its generation: its blocks
    # are still there, and its retention still pulls.
    back = await c.nodes.Register(node_request("d-1", generation=first.node.generation))
    assert back.node.generation == first.node.generation
    assert (await c.leases.Lookup(lookup_request("held"))).decision == leases_pb2.PULL


async def test_collection_loses_to_a_concurrent_registration(client: Client, daemon: Daemon) -> None:
    await client.nodes.Register(node_request("d-1", liveness_ttl_seconds=2))
    store = daemon.control_plane.store  # type: ignore[union-attr]

    async def lapsed() -> bool:  # (etcd expires leases on a 500 ms tick: not at the TTL exactly)
        state, _ = await store.nodes.get("d-1")
        return state is not None and not state.alive

    await eventually(lapsed, within=10)
    state, revision = await store.nodes.get("d-1")
    assert state is not None and not state.alive
    await client.nodes.Register(node_request("d-1"))  # back before the collector acted
    assert not await store.nodes.collect("d-1", revision, state.record.generation)
    now, _ = await store.nodes.get("d-1")
    assert now is not None and now.alive


async def test_live_and_recently_dead_nodes_are_kept(client: Client, daemon: Daemon) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.nodes.Register(node_request("d-2"))
    await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d-2"))
    cp = daemon.control_plane
    assert cp is not None
    await cp.nodes.refresh()
    assert await cp.registry.collect_dead() == 0  # default: a day
    assert (await cp.store.nodes.get("d-2"))[0] is not None


async def test_the_floor_is_only_written_when_it_rises(client: Client, daemon: Daemon) -> None:
    from aetcd import rpc

    store = daemon.control_plane.store  # type: ignore[union-attr]

    async def floor() -> tuple[int, int]:
        resp = await store._client.kvstub.Range(rpc.RangeRequest(key=store.keys.generation_floor))
        return (int(resp.kvs[0].value), int(resp.kvs[0].mod_revision)) if resp.kvs else (0, 0)

    for engine, times in (("d-high", 3), ("d-low", 1)):
        for _ in range(times):
            await client.nodes.Register(node_request(engine))
        await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id=engine))
    assert await store.nodes.collect("d-high", (await store.nodes.get("d-high"))[1], 3)
    raised = await floor()
    assert raised[0] == 3
    assert await store.nodes.collect("d-low", (await store.nodes.get("d-low"))[1], 1)
    assert await floor() == raised  # not rewritten: registrations have nothing to conflict on


async def test_a_refresh_that_read_before_a_deregistration_does_not_bring_the_node_back(
    client: Client, daemon: Daemon
) -> None:
    """The node cache's refresh read the node alive; the node was deregistered before that
    read was taken in. The cache keeps the tombstone: lookups do not hand out the removed
    node's blocks until the next refresh."""
    cp = daemon.control_plane
    assert cp is not None
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    real = cp.store.nodes.load
    read, go_on = asyncio.Event(), asyncio.Event()

    async def slow_load():  # type: ignore[no-untyped-def]
        loaded = await real()
        read.set()
        await go_on.wait()
        return loaded

    cp.store.nodes.load = slow_load  # type: ignore[method-assign]
    refresh = asyncio.ensure_future(cp.nodes.refresh())
    await read.wait()
    await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d-1"))
    go_on.set()
    await refresh
    cp.store.nodes.load = real  # type: ignore[method-assign]
    state = cp.nodes.snapshot()["d-1"]
    assert not state.alive and state.record.removed_at
    answer = await client.leases.Lookup(lookup_request("c"))
    assert answer.decision == leases_pb2.RECOMPUTE and answer.reason == "node_gone"

"""A node nobody vouches for is suspended, and a pull is decided on the node as it stands.

An engine restarted under a fixed engine id is the same id to P, which then reads the
new process's memory at the old block ids (sidecar/identity.py). The daemon's part:
a node whose sidecar's Attach stream ended hands no retention out until a sidecar
registers it again (its generation kept: a stall voids nothing), and a pull is never
decided on a replica's cached view of the node.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from controlplane.daemon import Daemon
from controlplane.errors import StoreUnavailable
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client, DaemonFactory
from tests.controlplane.test_claims_and_nodes import AttachStream, hello
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually


async def _node(client: Client, engine_id: str = "d-1") -> nodes_pb2.Node:
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))).nodes
    [node] = [n for n in nodes if n.engine_id == engine_id]
    return node


async def test_a_node_whose_stream_ended_is_suspended_and_keeps_its_generation(
    daemon: Daemon, client: Client
) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    stream = AttachStream(client)
    await stream.send(hello("d-1"))
    await stream.close()

    async def suspended() -> bool:
        return (await _node(client)).suspended

    await eventually(suspended)
    node = await _node(client)
    assert not node.alive and node.generation == 1
    peek = await client.leases.Lookup(lookup_request("c", peek=True))
    assert (peek.decision, peek.reason) == (leases_pb2.RECOMPUTE, "node_gone")
    assert "suspended" in peek.detail
    refused = AttachStream(client)  # a hello does not revive it: a registration must
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await refused.send(hello("d-1"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "suspended" in str(e.value.details())
    finally:
        await refused.close()

    # The same process, confirmed by its sidecar, registers its generation again.
    again = await client.nodes.Register(node_request("d-1", generation=1))
    assert again.node.generation == 1 and not again.node.suspended and not again.restarted
    assert (await client.leases.Lookup(lookup_request("c"))).decision == leases_pb2.PULL


async def test_a_stream_that_ended_hands_nothing_out_before_its_suspension_is_in_etcd(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suspension is an etcd write, an fsync away (seconds when etcd is in trouble).
    The replica whose stream ended knows at once that nobody vouches for the engine: it
    handed the retention out until the write was through."""
    cp = daemon.control_plane
    assert cp is not None
    store = cp.attachments._store
    through = asyncio.Event()
    real_suspend = store.suspend

    async def held_suspend(rec, now):  # type: ignore[no-untyped-def]
        await through.wait()
        return await real_suspend(rec, now)

    monkeypatch.setattr(store, "suspend", held_suspend)
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    stream = AttachStream(client)
    await stream.send(hello("d-1"))
    await stream.close()
    try:
        await eventually(lambda: _streams(daemon, 0))
        peek = await client.leases.Lookup(lookup_request("c", peek=True))
        assert (peek.decision, peek.reason) == (leases_pb2.RECOMPUTE, "node_gone")
        assert not (await _node(client)).suspended  # (etcd has not heard of it yet)
    finally:
        through.set()  # (or the daemon's stop waits for the held suspension forever)

    async def suspended() -> bool:
        return (await _node(client)).suspended

    await eventually(suspended)
    # The same process registers again: a new liveness lease, which the doubt is not about.
    await client.nodes.Register(node_request("d-1", generation=1))
    assert (await client.leases.Lookup(lookup_request("c", peek=True))).decision == leases_pb2.PULL


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
async def test_a_suspension_etcd_did_not_take_is_tried_again(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch, applied: bool
) -> None:
    """The first try fails as it does when etcd is slow or its member is killed (the write
    applied or not): the node still ends suspended, not merely dead once its liveness
    lapses (a hello would then revive it without a registration)."""
    cp = daemon.control_plane
    assert cp is not None
    store = cp.attachments._store
    real_suspend = store.suspend
    tries: list[str] = []

    async def lost_answer(rec, now):  # type: ignore[no-untyped-def]
        tries.append("suspend")
        if len(tries) == 1:
            if applied:
                await real_suspend(rec, now)
            raise StoreUnavailable("etcd suspend_node: DEADLINE_EXCEEDED")
        return await real_suspend(rec, now)

    monkeypatch.setattr(store, "suspend", lost_answer)
    await client.nodes.Register(node_request("d-1"))
    stream = AttachStream(client)
    await stream.send(hello("d-1"))
    await stream.close()

    async def suspended() -> bool:
        return (await _node(client)).suspended

    await eventually(suspended)
    await eventually(lambda: len(tries) == 2)
    node = await _node(client)
    assert not node.alive and node.generation == 1


def _streams(daemon: Daemon, n: int) -> bool:
    assert daemon.control_plane is not None
    return len(daemon.control_plane.attachments._streams) == n


async def test_a_stream_ending_after_a_newer_registration_suspends_nothing(
    daemon: Daemon, client: Client
) -> None:
    """The sidecar failed over and registered through another replica: the old stream's
    end, seen late, must not suspend the registration that replaced it."""
    assert daemon.control_plane is not None
    await client.nodes.Register(node_request("d-1"))
    old = AttachStream(client)
    await old.send(hello("d-1"))
    await client.nodes.Register(node_request("d-1", generation=1))  # (a new liveness lease)
    await old.close()
    await eventually(lambda: _stream_count(daemon, 0))
    await daemon.control_plane.settle()
    node = await _node(client)
    assert node.alive and not node.suspended
    await client.leases.Register(lease_request("c"))
    assert (await client.leases.Lookup(lookup_request("c", peek=True))).decision == leases_pb2.PULL


def _stream_count(daemon: Daemon, n: int) -> bool:
    """`n` Attach streams, and what the ended ones started (suspensions) done."""
    assert daemon.control_plane is not None
    return _streams(daemon, n) and daemon.control_plane.background.idle


async def test_a_stopping_replica_suspends_none_of_its_nodes(make_daemon: DaemonFactory, connect) -> None:  # type: ignore[no-untyped-def]
    """Its sidecars fail over and re-register elsewhere; suspending them all on the way out
    would make every retention of theirs node_gone for that while (a rolling upgrade)."""
    a = await make_daemon()
    b = await make_daemon(etcd=a.settings.etcd)
    ca, cb = connect(a), connect(b)
    await ca.nodes.Register(node_request("d-1"))
    stream = AttachStream(ca)
    await stream.send(hello("d-1"))
    await a.stop()
    await stream.close()
    node = await _node(cb)
    assert node.alive and not node.suspended


async def test_a_pull_is_not_decided_on_a_stale_view_of_the_node(make_daemon: DaemonFactory, connect) -> None:  # type: ignore[no-untyped-def]
    """D restarted and was registered anew through replica A; replica B's cached view
    still had the old generation alive, and B handed the old process's retention out
    (to a P that would read the new process's memory) until its next refresh."""
    a = await make_daemon()
    stale = replace(a.settings, nodes=replace(a.settings.nodes, cache_refresh_s=60.0))
    b = await make_daemon(stale)
    ca, cb = connect(a), connect(b)
    await ca.nodes.Register(node_request("d-1"))
    await ca.leases.Register(lease_request("c"))
    await cb.leases.Register(lease_request("warm"))  # B has cached generation 1, alive
    again = await ca.nodes.Register(node_request("d-1", engine_started_at=2.0))
    assert again.node.generation == 2
    answer = await cb.leases.Lookup(lookup_request("c"))
    assert (answer.decision, answer.reason) == (leases_pb2.RECOMPUTE, "node_restarted")

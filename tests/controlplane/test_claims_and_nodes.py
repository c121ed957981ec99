"""Claims across replicas, node liveness and generations, on a real etcd."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controlplane.daemon import Daemon
from controlplane.server.inbox import Inbox
from controlplane.settings import EtcdSettings
from kvferry.v1 import leases_pb2, nodes_pb2
from realvllm.process import free_port
from tests.conftest import Client, DaemonFactory
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually


async def test_exactly_one_pull_among_100_concurrent_lookups_on_two_replicas(
    make_daemon: DaemonFactory, connect
) -> None:  # type: ignore[no-untyped-def]
    a = await make_daemon()
    b = await make_daemon(etcd=a.settings.etcd)  # same etcd, same prefix: two replicas
    ca, cb = connect(a), connect(b)
    await ca.nodes.Register(node_request("d-1"))
    for round_ in range(3):
        conv = f"race-{round_}"
        await ca.leases.Register(lease_request(conv))
        calls = [(ca if i % 2 else cb).leases.Lookup(lookup_request(conv)) for i in range(100)]
        results = await asyncio.gather(*calls)
        pulls = [r for r in results if r.decision == leases_pb2.PULL]
        assert len(pulls) == 1, f"round {round_}: {len(pulls)} PULLs"
        assert {r.reason for r in results if r.decision == leases_pb2.RECOMPUTE} == {"already_claimed"}


async def attach(
    client: Client, engine_id: str, generation: int, beats: asyncio.Event
) -> AsyncIterator[None]:
    """Hold an Attach stream open, heartbeating every 0.5 s until `beats` is cleared."""
    queue: asyncio.Queue[nodes_pb2.AttachRequest | None] = asyncio.Queue()
    await queue.put(
        nodes_pb2.AttachRequest(hello=nodes_pb2.AttachHello(engine_id=engine_id, generation=generation))
    )

    async def requests() -> AsyncIterator[nodes_pb2.AttachRequest]:
        while (item := await queue.get()) is not None:
            yield item

    call = client.nodes.Attach(requests())
    first = await call.read()
    assert first.attached.engine_id == engine_id and first.ttl_seconds > 0

    async def beat() -> None:
        seq = 0
        while beats.is_set():
            seq += 1
            await queue.put(nodes_pb2.AttachRequest(heartbeat=nodes_pb2.Heartbeat(seq=seq)))
            ack = await call.read()
            assert ack.heartbeat_ack.seq == seq
            await asyncio.sleep(0.5)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        beats.clear()
        await task
        await queue.put(None)
        call.cancel()


async def test_node_stays_alive_while_attached_and_lapses_after(client: Client) -> None:
    # (3 s: a 0.5 s heartbeat seen late on a loaded 2-core machine lapsed a 2 s TTL once)
    await client.nodes.Register(node_request("d-1", liveness_ttl_seconds=3))
    await client.leases.Register(lease_request("conv-a"))
    await client.leases.Register(lease_request("conv-b"))
    beats = asyncio.Event()
    beats.set()
    gen = attach(client, "d-1", 1, beats)
    await gen.__anext__()
    await asyncio.sleep(4.0)  # longer than the TTL: heartbeats keep it alive
    alive = await client.leases.Lookup(lookup_request("conv-a", peek=True))
    assert alive.decision == leases_pb2.PULL
    with pytest.raises(StopAsyncIteration):
        await gen.__anext__()  # stop heartbeating and close the stream

    async def lapsed() -> bool:  # (etcd expires leases on a 500 ms tick: not at the TTL exactly)
        nodes = await client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))
        return [n.alive for n in nodes.nodes] == [False]

    await eventually(lapsed, within=15)
    assert not (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    gone = await client.leases.Lookup(lookup_request("conv-b"))
    assert gone.decision == leases_pb2.RECOMPUTE and gone.reason == "node_gone"
    assert not gone.HasField("release_params")


async def test_restarted_engine_makes_old_blocks_dead(client: Client) -> None:
    first = await client.nodes.Register(node_request("d-1"))
    assert first.node.generation == 1 and not first.restarted
    await client.leases.Register(lease_request("conv-old"))
    again = await client.nodes.Register(node_request("d-1"))  # engine came back: next generation
    assert again.node.generation == 2 and again.restarted
    resp = await client.leases.Lookup(lookup_request("conv-old"))
    assert resp.decision == leases_pb2.RECOMPUTE and resp.reason == "node_restarted"
    # A sidecar still speaking for generation 1 is told so.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Register(_with_generation("conv-new", 1))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    fresh = await client.leases.Register(lease_request("conv-new"))
    assert fresh.lease.generation == 2
    assert (await client.leases.Lookup(lookup_request("conv-new"))).decision == leases_pb2.PULL
    with pytest.raises(grpc.aio.AioRpcError) as back:
        await client.nodes.Register(node_request("d-1", generation=1))
    assert back.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "older" in (
        back.value.details() or ""
    )


def _with_generation(conv: str, generation: int) -> leases_pb2.RegisterLeaseRequest:
    req = lease_request(conv)
    req.generation = generation
    return req


async def test_attach_with_stale_generation_is_refused(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.nodes.Register(node_request("d-1"))

    async def hello() -> AsyncIterator[nodes_pb2.AttachRequest]:
        yield nodes_pb2.AttachRequest(hello=nodes_pb2.AttachHello(engine_id="d-1", generation=1))

    call = client.nodes.Attach(hello())
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_deregister_kills_retentions(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("conv-d"))
    assert (await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d-1"))).found
    resp = await client.leases.Lookup(lookup_request("conv-d", peek=True))
    assert resp.reason == "node_gone"
    assert not (await client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))).nodes
    # A sidecar that still speaks for generation 1 comes back: it gets a new generation,
    # so the deregistered node's retentions never come back to life.
    back = await client.nodes.Register(node_request("d-1", generation=1))
    assert back.node.generation == 2 and back.restarted
    resp = await client.leases.Lookup(lookup_request("conv-d"))
    assert resp.reason == "node_restarted"
    assert not (await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="nobody"))).found


async def test_lease_survives_a_daemon_restart_on_the_embedded_etcd(
    make_daemon: DaemonFactory, connect, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    embedded = EtcdSettings(
        endpoints=(), data_dir=tmp_path / "etcd", embedded_client_port=port, embedded_peer_port=free_port()
    )
    first = await make_daemon(etcd=embedded)
    assert first.embedded is not None
    c = connect(first)
    await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=30))
    await c.leases.Register(lease_request("conv-keep"))
    await first.stop()  # stops its etcd too
    second = await make_daemon(etcd=embedded)
    resp = await connect(second).leases.Lookup(lookup_request("conv-keep"))
    assert resp.decision == leases_pb2.PULL


class AttachStream:
    """One Attach stream driven by hand: hello, heartbeats, KV events."""

    def __init__(self, client: Client) -> None:
        self._queue: asyncio.Queue[nodes_pb2.AttachRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[nodes_pb2.AttachRequest]:
            while (item := await self._queue.get()) is not None:
                yield item

        self.call = client.nodes.Attach(requests())

    async def send(
        self, msg: nodes_pb2.AttachRequest, answered: bool = True
    ) -> nodes_pb2.AttachResponse | None:
        await self._queue.put(msg)
        return await self.call.read() if answered else None

    async def close(self) -> None:
        await self._queue.put(None)
        self.call.cancel()


def hello(engine_id: str, generation: int = 1) -> nodes_pb2.AttachRequest:
    return nodes_pb2.AttachRequest(hello=nodes_pb2.AttachHello(engine_id=engine_id, generation=generation))


def heartbeat(seq: int) -> nodes_pb2.AttachRequest:
    return nodes_pb2.AttachRequest(heartbeat=nodes_pb2.Heartbeat(seq=seq))


async def test_a_lapsed_liveness_lease_is_renewed_once_not_per_heartbeat(
    daemon: Daemon, client: Client
) -> None:
    """After an etcd outage or a long pause the node's lease is gone: the next heartbeat
    grants a new one, and the ones after refresh it (no grant, no record rewrite each)."""
    assert daemon.control_plane is not None
    store = daemon.control_plane.store
    await client.nodes.Register(node_request("d-1"))
    stream = AttachStream(client)
    try:
        await stream.send(hello("d-1"))
        state, _ = await store.nodes.get("d-1")
        assert state is not None
        await store.kv.revoke_quietly(state.record.lease_id)  # the lapse
        await stream.send(heartbeat(1))
        renewed, revision = await store.nodes.get("d-1")
        assert renewed is not None and renewed.alive and renewed.record.lease_id != state.record.lease_id
        for seq in (2, 3, 4):
            ack = await stream.send(heartbeat(seq))
            assert ack is not None and ack.ttl_seconds > 0
        after, revision_after = await store.nodes.get("d-1")
        assert after is not None and after.record.lease_id == renewed.record.lease_id
        assert revision_after == revision  # the record was not written again
    finally:
        await stream.close()


async def test_an_older_attach_stream_ending_keeps_the_newer_ones_index(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert daemon.control_plane is not None
    attachments = daemon.control_plane.attachments
    index = attachments.index
    detached: list[object] = []  # this daemon's streams that ended (the gauge is every daemon's)
    detach = attachments.detach
    monkeypatch.setattr(
        attachments, "detach", lambda rec, stream: (detached.append(stream), detach(rec, stream))
    )
    await client.nodes.Register(node_request("d-1"))
    old, new = AttachStream(client), AttachStream(client)
    try:
        await old.send(hello("d-1"))
        await new.send(hello("d-1"))  # the sidecar reconnected before the old stream ended
        events = nodes_pb2.KvEventBatch(stored=[1, 2, 3], reset=True)
        await new.send(nodes_pb2.AttachRequest(kv_events=events), answered=False)

        async def indexed() -> bool:
            return index.count("d-1") == 3

        await eventually(indexed, within=30)
        late = nodes_pb2.KvEventBatch(stored=[9])  # a late delta on the superseded stream: ignored
        await old.send(nodes_pb2.AttachRequest(kv_events=late), answered=False)
        assert await old.send(heartbeat(1)) is not None  # (answered in order: the delta was taken)
        assert index.count("d-1") == 3 and not index.contains("d-1", 9)
        await old.close()

        async def old_ended() -> bool:
            return len(detached) == 1

        await eventually(old_ended, within=30)
        assert index.count("d-1") == 3
        # One stream speaks for one engine.
        await client.nodes.Register(node_request("d-2"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await new.send(hello("d-2"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await old.close()
        await new.close()

    async def dropped() -> bool:  # and when the newer one ends, the index goes with it
        return index.count("d-1") == 0

    await eventually(dropped, within=30)


async def test_an_attach_stream_cancelled_as_it_closes_still_detaches_its_node(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's end reaches the handler twice: its requests end, then gRPC cancels it.
    The cancellation used to land in the handler's close of its request reader, before the
    node was detached: the node stayed attached (never suspended) until the daemon stopped.
    Here closing the reader waits until the end of the test, so only a detach that does
    not wait for it passes."""
    assert daemon.control_plane is not None
    attachments = daemon.control_plane.attachments
    detached: list[object] = []
    detach = attachments.detach
    monkeypatch.setattr(
        attachments, "detach", lambda rec, stream: (detached.append(stream), detach(rec, stream))
    )

    closed, close = asyncio.Event(), Inbox.close

    async def close_held(self: Inbox[object]) -> None:
        await closed.wait()
        await close(self)

    monkeypatch.setattr(Inbox, "close", close_held)
    await client.nodes.Register(node_request("d-1"))
    stream = AttachStream(client)
    try:
        await stream.send(hello("d-1"))
        await stream.close()
        await eventually(lambda: len(detached) == 1, within=30)

        async def suspended() -> bool:
            state, _ = await daemon.control_plane.store.nodes.get("d-1")  # type: ignore[union-attr]
            return state is not None and bool(state.record.suspended_at)

        await eventually(suspended, within=30)
    finally:
        closed.set()


async def test_a_replica_with_a_stale_node_cache_accepts_the_new_generations_leases(
    make_daemon: DaemonFactory, connect
) -> None:  # type: ignore[no-untyped-def]
    """The engine restarted and re-registered through replica A; its sidecar's next lease
    reaches replica B, whose node cache still holds the old generation: B looks again."""
    a = await make_daemon()
    b = await make_daemon(etcd=a.settings.etcd)
    ca, cb = connect(a), connect(b)
    await ca.nodes.Register(node_request("d-1"))
    await cb.leases.Register(lease_request("warm"))  # B has cached generation 1
    again = await ca.nodes.Register(node_request("d-1"))
    assert again.node.generation == 2
    req = lease_request("c")
    req.generation = 2
    stored = await cb.leases.Register(req)
    assert stored.lease.generation == 2


async def test_a_refresh_read_before_a_registration_does_not_put_the_old_generation_back(
    daemon: Daemon, client: Client
) -> None:
    """A node-cache refresh whose read started before the engine re-registered (generation
    2, through this replica) ends after it: the cache keeps generation 2. It put generation
    1 back, so lookups handed out the dead process's retentions until the next refresh."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("old"))  # generation 1's
    cache = daemon.control_plane.nodes
    store = daemon.control_plane.store
    read_done, let_go = asyncio.Event(), asyncio.Event()
    load = store.nodes.load

    async def slow_load():  # type: ignore[no-untyped-def]
        loaded = await load()
        read_done.set()
        await let_go.wait()
        return loaded

    store.nodes.load = slow_load  # type: ignore[method-assign]
    refresh = asyncio.create_task(cache.refresh())
    await read_done.wait()  # it has read generation 1
    assert (await client.nodes.Register(node_request("d-1"))).node.generation == 2
    let_go.set()
    await refresh
    state = await cache.get("d-1")
    assert state is not None and state.record.generation == 2
    looked = await client.leases.Lookup(lookup_request("old"))
    assert looked.reason == "node_restarted"


async def test_a_node_keeps_its_generation_only_for_the_same_engine_process(client: Client) -> None:
    """Generation 0 asks for a new one, unless the sidecar saw no restart and the engine's
    start time is the one on record (a sidecar restart). A deregistered node never keeps it."""

    def req(started_at: float, no_restart_seen: bool = True) -> nodes_pb2.RegisterNodeRequest:
        r = node_request("d-1")
        r.engine_started_at, r.no_restart_seen = started_at, no_restart_seen
        return r

    assert (await client.nodes.Register(req(1000.5))).node.generation == 1
    kept = await client.nodes.Register(req(1000.5))
    assert kept.node.generation == 1 and not kept.restarted
    assert (await client.nodes.Register(req(1000.5, no_restart_seen=False))).node.generation == 2
    assert (await client.nodes.Register(req(2000.0))).node.generation == 3  # another process
    assert (await client.nodes.Register(req(0.0))).node.generation == 4  # start unknown
    await client.nodes.Register(req(3000.0))
    await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d-1"))
    assert (await client.nodes.Register(req(3000.0))).node.generation == 6
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await client.nodes.Register(req(float("nan")))
    assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT

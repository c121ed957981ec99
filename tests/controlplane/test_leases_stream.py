"""Leases/Stream on the daemon's side (the sidecar's and router's path): many ops per
message with an answer or error each, a window of unread results, keepalive pings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from controlplane.service import nodecache
from kvferry.v1 import leases_pb2, nodes_pb2, nodes_pb2_grpc
from tests.conftest import Client, Daemon
from tests.factories import beside_other_replicas, lease_request, lookup_request, node_request


async def test_stream_multiplexes_register_and_lookup_with_per_op_errors(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    ops = [leases_pb2.LeaseOp(id=i, register=lease_request(f"s-{i}")) for i in range(50)]
    bad = lease_request("s-bad")
    bad.num_tokens = -1
    ops.append(leases_pb2.LeaseOp(id=999, register=bad))
    ops.append(leases_pb2.LeaseOp(id=1000))  # no op at all

    async def run(items: list[leases_pb2.LeaseOp]) -> list[leases_pb2.LeaseOpResult]:
        # Written explicitly, several ops per message as LeaseStream sends them, then half-closed.
        call = client.leases.Stream()
        for i in range(0, len(items), 7):
            await call.write(leases_pb2.LeaseOpBatch(ops=items[i : i + 7]))
        await call.done_writing()
        return [r async for batch in call for r in batch.results]

    results = {r.id: r for r in await run(ops)}
    assert set(results) == set(range(50)) | {999, 1000}
    assert all(results[i].WhichOneof("result") == "register" for i in range(50))
    assert results[999].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "num_tokens -1" in results[999].error.message
    assert results[1000].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    lookups = [leases_pb2.LeaseOp(id=i, lookup=lookup_request(f"s-{i % 50}")) for i in range(100)]
    answers = await run(lookups)
    pulls = [r for r in answers if r.lookup.decision == leases_pb2.PULL]
    assert len(answers) == 100 and len(pulls) == 50, "each lease handed out exactly once"
    assert {r.id % 50 for r in pulls} == set(range(50))


async def _stream_lookup(client: Client, conversation_id: str) -> leases_pb2.LookupResponse:
    call = client.leases.Stream()
    await call.write(
        leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, lookup=lookup_request(conversation_id))])
    )
    await call.done_writing()
    (result,) = [r async for batch in call for r in batch.results]
    return result.lookup


async def test_a_turn_decided_in_memory_is_answered_by_the_reader_with_no_task(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup whose claim is in its owner's memory and whose node was confirmed by a read
    less than CONFIRM_S old is answered by the stream's reader (Lookups.lookup_now); one
    whose node must be read first is left to the awaited path, having claimed nothing.
    Either way the retention is handed out exactly once, with its params."""
    cp = daemon.control_plane
    awaited: list[str] = []
    lookup = cp.lookups.lookup

    async def counted(q, later=None):  # type: ignore[no-untyped-def]
        awaited.append(q.conversation_id)
        return await lookup(q, later)

    monkeypatch.setattr(cp.lookups, "lookup", counted)
    beside_other_replicas(monkeypatch, daemon)
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("first"))
    # Nothing has read d-1 for a lookup yet: the pull waits for that read, in a task.
    first = await _stream_lookup(client, "first")
    assert (first.decision, first.claimed) == (leases_pb2.PULL, True)
    assert first.kv_transfer_params.fields["remote_engine_id"].string_value == "d-1"
    assert awaited == ["first"]
    # Its read is now fresh: the next turn needs no await. (CONFIRM_S made long: on a busy
    # machine the next lookup could come after a 50 ms window, and rightly await a read.)
    monkeypatch.setattr(nodecache, "CONFIRM_S", 60.0)
    conversation = "second"
    await client.leases.Register(lease_request(conversation))
    res = await _stream_lookup(client, conversation)
    assert (res.decision, res.claimed) == (leases_pb2.PULL, True), res
    assert res.kv_transfer_params.fields["remote_engine_id"].string_value == "d-1"
    assert awaited == ["first"]  # (answered by the reader)
    again = await _stream_lookup(client, conversation)
    assert (again.decision, again.reason, again.claimed) == (leases_pb2.RECOMPUTE, "already_claimed", False)


async def test_a_stream_whose_results_are_not_read_stops_reading_its_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Results wait for a client that does not read them: at most a window of them, then the
    daemon stops taking ops from that stream (and gRPC flow control holds the client)."""
    from controlplane.server import stream
    from controlplane.server.leases import LeasesServicer

    monkeypatch.setattr(stream, "STREAM_WINDOW", 4)
    pulled = 0

    async def ops() -> AsyncIterator[leases_pb2.LeaseOpBatch]:
        nonlocal pulled
        for i in range(50):
            pulled += 1  # a prompt for no waiting lookup: refused at once, no store needed
            yield leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=i, prompt=leases_pb2.LookupPrompt())])

    servicer = LeasesServicer(None, None)  # type: ignore[arg-type]
    results = servicer.Stream(ops(), None)  # type: ignore[arg-type]
    batch_of = leases_pb2.LeaseOpResultBatch.FromString  # (the handler yields them encoded)
    first = batch_of(await results.__anext__())  # the client reads once, then stops
    await asyncio.sleep(0.2)
    # (a window sent, a window waiting to be, and the batch the reader holds)
    assert 1 <= len(first.results) <= 4 and pulled <= 2 * 4 + 2, (len(first.results), pulled)
    got = len(first.results)
    async for batch in results:  # reading again lets the rest through
        got += len(batch_of(batch).results)
    assert got == 50 and pulled == 50


async def test_the_daemon_allows_its_clients_keepalive_pings(
    make_daemon, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Routers and sidecars ping the daemon on idle connections (kvferry.channels). A server
    that allows fewer pings answers the third with GOAWAY too_many_pings, ending every
    stream on the connection, and the client then pings half as often. Here every second
    (the fewest gRPC clients send) instead of every 10 s."""
    import controlplane.server
    import kvferry.channels

    monkeypatch.setattr(kvferry.channels, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(controlplane.server, "KEEPALIVE_TIME_MS", 1000)
    daemon = await make_daemon()
    channel = grpc.aio.insecure_channel(daemon.address, options=kvferry.channels.daemon_channel_options(1000))
    try:
        await nodes_pb2_grpc.NodesStub(channel).List(nodes_pb2.ListNodesRequest())
        states = set()
        for _ in range(40):  # idle, pinging
            states.add(channel.get_state())
            await asyncio.sleep(0.1)
        assert states == {grpc.ChannelConnectivity.READY}, states  # (a GOAWAY leaves it IDLE)
    finally:
        await channel.close(None)

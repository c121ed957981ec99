"""A release decided at one replica reaches a decode node whose sidecar is attached to
another (controlplane.service.relay): with shard owners the replica that decides (a
shard's new owner spending what an unclean takeover found, a put-back's replica) is
often not the one the node's Attach stream is held by. It used to wait there, never
sent, D's blocks held to their TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from google.protobuf import struct_pb2

from controlplane.budget import Reason
from controlplane.daemon import Daemon
from controlplane.forward import RELEASE_TIMEOUT_S, OwnerClient
from controlplane.owners.memory import Conversation
from controlplane.records import Retention
from controlplane.service.budgets import Release
from kvferry.structs import struct_to_dict
from kvferry.v1 import nodes_pb2
from tests.conftest import Client, DaemonFactory
from tests.controlplane.test_claims_and_nodes import AttachStream, hello
from tests.controlplane.test_put_back_orphans import (
    HeldPutBack,
    _cancelled_claim,
    _releases_before_ack,
    _turn,
)
from tests.factories import d_params, node_request
from tests.polling import eventually

Connect = Callable[[Daemon], Client]


def _retention(request_id: str) -> Retention:
    params = struct_pb2.Struct()
    params.update(d_params("d-1", 160, request_id))
    now = time.time()
    return Retention(
        engine_id="d-1",
        generation=1,
        params=params.SerializeToString(deterministic=True),
        num_tokens=160,
        block_size=16,
        created_at=now,
        expires_at=now + 300,
        digests=b"",
        request_id=request_id,
    )


async def _replicas(make_daemon: DaemonFactory) -> tuple[Daemon, Daemon]:
    """Two replicas on one etcd prefix, each following the other."""
    a = await make_daemon()
    b = await make_daemon(a.settings)

    async def following() -> bool:
        assert a.peers is not None and b.peers is not None
        return a.peers.addresses == [b.address] and b.peers.addresses == [a.address]

    await eventually(following, within=20)
    return a, b


async def _attach(client: Client) -> AttachStream:
    stream = AttachStream(client)
    first = await stream.send(hello("d-1"))
    assert first is not None and first.HasField("attached")
    return stream


def _spend_at(d: Daemon, conversation_id: str, request_id: str) -> None:
    """`d` took over a shard uncleanly and found the conversation's retention: spent,
    its blocks released (reason failover), decided at `d`."""
    assert d.control_plane is not None
    d.control_plane._spent([(Conversation("default", conversation_id), _retention(request_id))])


async def _release(stream: AttachStream) -> nodes_pb2.ReleaseRetention:
    """The next message on the stream: a release."""
    msg = await asyncio.wait_for(stream.call.read(), 10)
    assert isinstance(msg, nodes_pb2.AttachResponse) and msg.HasField("release"), msg
    return msg.release


async def test_a_release_decided_at_another_replica_reaches_the_node_through_its_own(
    make_daemon: DaemonFactory, connect: Connect
) -> None:
    a, b = await _replicas(make_daemon)
    ca = connect(a)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60), timeout=10)
    stream = await _attach(ca)
    try:
        _spend_at(b, "c", "turn-1")
        release = await _release(stream)
        assert (release.conversation_id, release.reason) == ("c", "failover")
        assert struct_to_dict(release.kv_transfer_params) == {
            **d_params("d-1", 160, "turn-1"),
            "remote_num_tokens": 0,
        }
        assert b.control_plane is not None and b.control_plane.budgets.relay.held == 0
        assert await _releases_before_ack(stream) == []  # (told once)
    finally:
        await stream.close()


async def test_a_release_for_a_node_attached_nowhere_reaches_it_where_it_attaches(
    make_daemon: DaemonFactory, connect: Connect
) -> None:
    """No replica takes it (the node's stream moves, or a forward fails): it is offered
    again until the node is attached somewhere, then told there once."""
    a, b = await _replicas(make_daemon)
    ca = connect(a)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60), timeout=10)
    _spend_at(b, "c", "turn-1")
    assert b.control_plane is not None
    relay = b.control_plane.budgets.relay
    assert relay.held == 1
    stream = await _attach(ca)
    try:
        release = await _release(stream)
        assert (release.conversation_id, release.reason) == ("c", "failover")

        async def handed_over() -> bool:
            return relay.held == 0

        await eventually(handed_over, within=5)
        assert await _releases_before_ack(stream) == []
    finally:
        await stream.close()


async def test_a_put_back_overtaken_at_another_replica_has_d_free_the_blocks(
    make_daemon: DaemonFactory, connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault suite's lost retention after quorum came back: the router's lookup ran
    at replica B (A had not answered in time), its caller went away, and its put-back met
    the turn's own registration. D's sidecar is attached to A: it is told through A."""
    a, b = await _replicas(make_daemon)
    ca, cb = connect(a), connect(b)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60), timeout=10)
    stream = await _attach(ca)
    try:
        await ca.leases.Register(_turn("c", "turn-1"), timeout=10)
        putting = HeldPutBack(b, monkeypatch)
        await _cancelled_claim(b, cb, monkeypatch)
        await asyncio.wait_for(putting.waiting.wait(), 10)
        await ca.leases.Register(_turn("c", "turn-2"), timeout=10)  # (it overtakes the put-back)
        putting.go.set()
        release = await _release(stream)
        assert (release.conversation_id, release.reason) == ("c", "orphan")
        assert struct_to_dict(release.kv_transfer_params)["remote_request_id"] == "turn-1"
        assert putting.results == [False]
    finally:
        await stream.close()


async def test_an_offer_taken_by_one_replica_does_not_wait_for_a_hung_one(
    make_daemon: DaemonFactory, connect: Connect
) -> None:
    """A replica stopped (SIGSTOP) answers no offer: the one holding the node's stream
    answers, and that is enough (every relay round waited RELEASE_TIMEOUT_S otherwise)."""
    a = await make_daemon()
    ca = connect(a)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60), timeout=10)
    stream = await _attach(ca)
    silent: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent.append(writer)  # (the connection stays open, and unanswered)

    hung = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    client = OwnerClient(None)
    try:
        hung_address = f"127.0.0.1:{hung.sockets[0].getsockname()[1]}"
        release = Release("default", "c", _retention("turn-1").params, Reason.FAILOVER, time.time() + 60)
        started = time.monotonic()
        assert await client.offer_releases([hung_address, a.address], "d-1", [release])
        assert time.monotonic() - started < RELEASE_TIMEOUT_S
        assert (await _release(stream)).conversation_id == "c"
    finally:
        await client.close()
        for w in silent:
            w.close()
        hung.close()
        await hung.wait_closed()
        await stream.close()

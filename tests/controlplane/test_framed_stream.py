"""Leases/Stream framed without gRPC (--stream-listen; kvferry.framedstream): the same ops
and answers as the gRPC method through the same LeaseStream client, bad frames answered
with a status and nothing lost, a dropped connection's claims put back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from controlplane.daemon import Daemon
from kvferry.framedstream import HEADER, FramedCall, end_status, frame, read_frame
from kvferry.leaseclient import LeaseOpError, LeaseStream
from kvferry.v1 import leases_pb2
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually


@pytest.fixture
async def framed(make_daemon: DaemonFactory, etcd_endpoint: str) -> Daemon:
    base = daemon_settings(etcd_endpoint)
    d = await make_daemon(replace(base, server=replace(base.server, stream_listen="127.0.0.1:0")))
    assert d.stream_port
    return d


@pytest.fixture
async def stream(framed: Daemon) -> AsyncIterator[LeaseStream]:
    s = LeaseStream(None, opener=lambda: FramedCall("127.0.0.1", framed.stream_port))
    yield s
    await s.close()


async def test_register_and_lookup_as_on_grpc(framed: Daemon, connect, stream: LeaseStream) -> None:  # type: ignore[no-untyped-def]
    client: Client = connect(framed)
    await client.nodes.Register(node_request("d-1"))
    for i in range(20):
        reg = await stream.register(lease_request(f"f-{i}"), 10)
        assert reg.lease.conversation_id == f"f-{i}"
    bad = lease_request("f-bad")
    bad.num_tokens = -1
    with pytest.raises(LeaseOpError) as info:
        await stream.register(bad, 10)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "num_tokens -1" in info.value.message
    # Two lookups of each conversation at once: each retention handed out exactly once.
    answers = await asyncio.gather(*(stream.lookup(lookup_request(f"f-{i % 20}"), 10) for i in range(40)))
    pulls = [a for a in answers if a.decision == leases_pb2.PULL]
    assert len(pulls) == 20 and all(a.claimed for a in pulls)
    assert {a.kv_transfer_params.fields["remote_engine_id"].string_value for a in pulls} == {"d-1"}
    # The gRPC side sees what the framed side did.
    lease = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="f-3"))
    assert lease.claimed


async def _raw(port: int, *frames: bytes) -> list[leases_pb2.LeaseOpResultBatch]:
    """Send `frames` on a new connection; -> every batch the daemon sent until it closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"".join(frames))
    out = []
    try:
        async with asyncio.timeout(30):
            while (payload := await read_frame(reader, 1 << 22)) is not None:
                out.append(leases_pb2.LeaseOpResultBatch.FromString(payload))
    finally:
        writer.close()
    return out


HELLO = frame(leases_pb2.StreamHello().SerializeToString())


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ((HELLO, frame(b"\xff\xff\xff")), "a LeaseOpBatch frame does not decode"),
        ((HELLO, HEADER.pack(64 * 1024 * 1024)), "over the limit of 4194304"),
        ((frame(b"\xff\xff\xff"),), "the first frame is no StreamHello"),
    ],
    ids=["undecodable-ops", "oversized-frame", "no-hello"],
)
async def test_a_bad_frame_ends_the_stream_with_invalid_argument(
    framed: Daemon, stream: LeaseStream, frames: tuple[bytes, ...], says: str
) -> None:
    batches = await _raw(framed.stream_port, *frames)
    status = end_status(batches[-1])
    assert status is not None and status[0] == grpc.StatusCode.INVALID_ARGUMENT, batches
    assert says in status[1]
    # Nothing else broke: the next stream's ops run.
    with pytest.raises(LeaseOpError) as info:
        await stream.lookup(lookup_request("nobody", prompt_tokens=0), 10)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_ops_before_done_writing_are_answered_then_the_stream_ends(framed: Daemon) -> None:
    op = leases_pb2.LeaseOp(id=7, lookup=lookup_request("none-here"))
    batches = await _raw(
        framed.stream_port,
        HELLO,
        frame(leases_pb2.LeaseOpBatch(ops=[op]).SerializeToString()),
        HEADER.pack(0),
    )
    results = [r for b in batches for r in b.results]
    assert [(r.id, r.lookup.reason) for r in results] == [(7, "no_lease")]
    assert all(end_status(b) is None for b in batches)  # (a clean end: no status frame)


async def test_a_dropped_connection_puts_its_claim_back(framed: Daemon, connect, stream: LeaseStream) -> None:  # type: ignore[no-untyped-def]
    """A lookup that claimed and waits for its prompt (prompt_follows), its connection then
    closed without a done-writing frame: a cancelled call, so the claim goes back and the
    next turn pulls it."""
    client: Client = connect(framed)
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("dropped"))
    waiting = lookup_request("dropped", prompt_tokens=0)
    waiting.prompt_follows = True
    reader, writer = await asyncio.open_connection("127.0.0.1", framed.stream_port)
    op = leases_pb2.LeaseOp(id=1, lookup=waiting)
    writer.write(HELLO + frame(leases_pb2.LeaseOpBatch(ops=[op]).SerializeToString()))
    assert await read_frame(reader, 1 << 20) == b""  # (admitted)

    async def claimed() -> bool:
        lease = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="dropped"))
        return lease.claimed

    async def put_back() -> bool:
        return not await claimed()

    await eventually(claimed, within=30)  # (the claim is in before the connection goes)
    writer.transport.abort()
    await eventually(put_back, within=30)
    answer = await stream.lookup(lookup_request("dropped"), 10)
    assert (answer.decision, answer.reason) == (leases_pb2.PULL, "pull")

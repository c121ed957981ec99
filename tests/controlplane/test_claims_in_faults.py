"""Claims in the faults of a real cluster (found by the fault suite, tests/faults): a claim's
write etcd applied or not but did not answer (the member the daemon talked to was killed,
an election) is sent again until etcd holds it, the retention handed out once; a retention whose node is out
of touch (its liveness lapsed while etcd had no quorum) is not spent by a lookup either."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.daemon import Daemon
from controlplane.errors import StoreUnavailable
from controlplane.owners.memory import Write
from kvferry.v1 import leases_pb2
from tests.conftest import Client
from tests.controlplane.test_claims_and_nodes import AttachStream, hello
from tests.factories import d_params, lease_request, lookup_request, node_request
from tests.polling import eventually


def unanswered(daemon: Daemon, monkeypatch: pytest.MonkeyPatch, written: bool) -> list[str]:
    """Make the owner's next fenced write fail as a killed etcd member's would:
    StoreUnavailable, after the transaction was applied (`written`) or not. -> one entry
    per send, as they go."""
    assert daemon.control_plane is not None
    store = daemon.control_plane.owners.store
    write = store.write
    sent: list[str] = []

    async def lost_answer(fences: dict[int, int], writes: list[Write], now: float) -> int:
        sent.append("write")
        if len(sent) > 1:
            return await write(fences, writes, now)
        if written:
            await write(fences, writes, now)
        raise StoreUnavailable(
            "etcd owner_write: UNAVAILABLE: Stream removed (recvmsg:Connection reset by peer)"
        )

    monkeypatch.setattr(store, "write", lost_answer)
    return sent


async def in_etcd(daemon: Daemon, conversation: str) -> tuple[bool, bool]:
    """(whether etcd holds the conversation's retention, whether its claim marker)."""
    assert daemon.control_plane is not None
    stored, marker = await daemon.control_plane.store.retentions.read("default", conversation)
    return stored is not None, marker is not None


@pytest.mark.parametrize("written", [True, False], ids=["applied", "not-applied"])
async def test_a_claims_write_etcd_did_not_answer_is_sent_again_and_handed_out_once(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch, written: bool
) -> None:
    """A claim is decided by its shard's owner in memory and answered before etcd has it
    (controlplane.owners): a write-behind etcd did not answer (applied or not) is sent
    again, in order, until etcd holds what memory does. (Before owners, a claim etcd did
    not apply answered store_unavailable; now it answers at once.)"""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    sent = unanswered(daemon, monkeypatch, written=written)

    res = await client.leases.Lookup(lookup_request("c"))

    assert res.decision == leases_pb2.PULL and res.claimed, res
    again = await client.leases.Lookup(lookup_request("c"))
    assert again.reason == "already_claimed"  # handed out once

    async def durable() -> bool:  # (sent again, and etcd holds what memory does)
        return len(sent) >= 2 and await in_etcd(daemon, "c") == (False, True)

    await eventually(durable)


async def test_a_retention_of_a_node_out_of_touch_is_kept_for_when_it_is_back(
    daemon: Daemon, client: Client
) -> None:
    """A node whose liveness lapsed or that was suspended (after etcd lost quorum for longer
    than the liveness TTL, every node is so until its next heartbeat) may still hold the
    blocks: a lookup meanwhile answers node_gone but does not spend the retention."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    stream = AttachStream(client)
    await stream.send(hello("d-1"))
    await stream.close()  # its stream ended: suspended until a sidecar vouches for it again

    async def out_of_touch() -> bool:
        return (await client.leases.Lookup(lookup_request("c", peek=True))).reason == "node_gone"

    await eventually(out_of_touch)
    gone = await client.leases.Lookup(lookup_request("c"))
    assert (gone.decision, gone.reason) == (leases_pb2.RECOMPUTE, "node_gone")
    assert not gone.HasField("release_params")

    await client.nodes.Register(node_request("d-1", generation=1))  # the same process, back

    async def pulled() -> bool:  # (put back in the background)
        return (await client.leases.Lookup(lookup_request("c"))).decision == leases_pb2.PULL

    await eventually(pulled)


async def test_a_node_out_of_touch_that_registers_again_gets_the_replaced_retention_to_free(
    daemon: Daemon, client: Client
) -> None:
    """Its next registration for the conversation replaces the retention nobody pulled: D
    still holds those blocks (the node registering is the proof), so they are handed back
    to be freed, not left to D's TTL."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c", params=d_params("d-1", 1000, "turn-1")))
    stream = AttachStream(client)
    await stream.send(hello("d-1"))
    await stream.close()

    async def out_of_touch() -> bool:
        return (await client.leases.Lookup(lookup_request("c", peek=True))).reason == "node_gone"

    await eventually(out_of_touch)
    res = await client.leases.Register(lease_request("c", params=d_params("d-1", 1000, "turn-2")))

    assert res.HasField("release_params")
    assert res.release_params["remote_request_id"] == "turn-1"


async def test_a_node_gone_answer_comes_after_its_retention_is_back(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn answered node_gone registers its own retention next: had the put-back not
    been written by then (an etcd slow after regaining quorum), the registration would
    overtake it, the put-back would find a newer retention, and the blocks it named would
    stay held for nobody (seen in the fault suite). So the answer waits for the put-back,
    and the registration replaces the retention and hands it back to be freed."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c", params=d_params("d-1", 1000, "turn-1")))
    stream = AttachStream(client)
    await stream.send(hello("d-1"))
    await stream.close()

    async def out_of_touch() -> bool:
        return (await client.leases.Lookup(lookup_request("c", peek=True))).reason == "node_gone"

    await eventually(out_of_touch)
    assert daemon.control_plane is not None
    retentions = daemon.control_plane.owned
    unclaim = retentions.unclaim

    async def slow_unclaim(*args: object, **kwargs: object) -> bool:
        await asyncio.sleep(0.2)  # (etcd slow: a background put-back would still be on its way)
        return await unclaim(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(retentions, "unclaim", slow_unclaim)
    gone = await client.leases.Lookup(lookup_request("c"))
    assert (gone.decision, gone.reason) == (leases_pb2.RECOMPUTE, "node_gone")
    res = await client.leases.Register(lease_request("c", params=d_params("d-1", 1000, "turn-2")))
    assert res.HasField("release_params")
    assert res.release_params["remote_request_id"] == "turn-1"

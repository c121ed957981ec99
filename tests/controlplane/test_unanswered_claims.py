"""A claim etcd wrote but did not answer (the member the daemon talked to was killed, an
election): the daemon reads back whether it was written, and hands out what it took
rather than spending it with nobody told. (Found by the fault suite, tests/faults: an
etcd member killed under load lost a retention now and then.)"""

from __future__ import annotations

import pytest
from aetcd import rpc

from controlplane.daemon import Daemon
from controlplane.errors import StoreUnavailable
from kvferry.v1 import leases_pb2
from tests.conftest import Client
from tests.factories import lease_request, lookup_request, node_request


def unanswered(daemon: Daemon, monkeypatch: pytest.MonkeyPatch, written: bool) -> list[str]:
    """Make the next claim fail as a killed etcd member's would: StoreUnavailable, after
    the transaction was applied (`written`) or not. -> the ops sent, as they go."""
    assert daemon.control_plane is not None
    batcher = daemon.control_plane.store.retentions._batcher
    submit = batcher.submit
    sent: list[str] = []

    async def lost_answer(op: str, txn: rpc.TxnRequest, keys: tuple[bytes, ...]) -> rpc.TxnResponse:
        sent.append(op)
        if op != "claim" or sent.count("claim") > 1:
            return await submit(op, txn, keys)
        if written:
            await submit(op, txn, keys)
        raise StoreUnavailable("etcd claim: UNAVAILABLE: Stream removed (recvmsg:Connection reset by peer)")

    monkeypatch.setattr(batcher, "submit", lost_answer)
    return sent


async def test_a_claim_written_but_not_answered_is_handed_out(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    unanswered(daemon, monkeypatch, written=True)

    res = await client.leases.Lookup(lookup_request("c"))

    assert res.decision == leases_pb2.PULL, res
    assert res.claimed
    again = await client.leases.Lookup(lookup_request("c"))
    assert again.reason == "already_claimed"  # handed out once


async def test_a_claim_not_written_fails_and_leaves_the_retention(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    unanswered(daemon, monkeypatch, written=False)

    res = await client.leases.Lookup(lookup_request("c"))

    assert res.reason == "store_unavailable" and not res.claimed, res
    again = await client.leases.Lookup(lookup_request("c"))
    assert again.decision == leases_pb2.PULL and again.claimed  # still there for the next

"""The retention budget on a real daemon and a real etcd: a decode node's sidecar reports
its pool on heartbeats, the daemon releases the least valuable retentions early (revoked in
etcd first, then a ReleaseRetention on the Attach stream), and a conversation's end
releases at once. Single use holds in both orders."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import msgspec
import pytest
from prometheus_client import REGISTRY

from controlplane.budget import MIN_OBSERVED, Budget, Pool, Reason
from controlplane.daemon import Daemon
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.controlplane.test_claims_and_nodes import AttachStream, hello
from tests.factories import d_params, lease_request, lookup_request, node_request

# Blocks of 16 tokens. Value per block-second ~ tokens per block (same age, same time left):
# "low" fills 20 blocks with 305 tokens (15.25 a block), the others 16 a block.
HELD = {"c-high": 480, "c-low": 305, "c-small": 160}  # 30 + 20 + 10 = 60 blocks


def beat(seq: int, pool_blocks: int, usage: float) -> nodes_pb2.AttachRequest:
    return nodes_pb2.AttachRequest(
        heartbeat=nodes_pb2.Heartbeat(seq=seq, pool_blocks=pool_blocks, pool_usage=usage)
    )


def released(reason: str) -> float:
    return REGISTRY.get_sample_value("kvferry_retention_releases_total", {"reason": reason}) or 0.0


async def _attached(client: Client) -> AttachStream:
    """d-1 registered, its sidecar attached, its retentions registered."""
    await client.nodes.Register(node_request("d-1"), timeout=10)
    stream = AttachStream(client)
    first = await stream.send(hello("d-1"))
    assert first is not None and first.HasField("attached")
    for conversation, tokens in HELD.items():
        await client.leases.Register(
            lease_request(conversation, num_tokens=tokens, params=d_params("d-1", tokens, conversation)),
            timeout=10,
        )
    return stream


async def _heartbeat(
    daemon: Daemon, stream: AttachStream, seq: int, pool: int, usage: float
) -> list[nodes_pb2.ReleaseRetention]:
    """One heartbeat, its budget pass done; -> the releases it made."""
    ack = await stream.send(beat(seq, pool, usage))
    assert ack is not None and ack.HasField("heartbeat_ack"), ack
    assert daemon.control_plane is not None
    await daemon.control_plane.background.settle()  # (the budget's revokes: in the background)
    out = []
    # The releases go out before the answer to a heartbeat sent after them.
    nxt = await stream.send(nodes_pb2.AttachRequest(heartbeat=nodes_pb2.Heartbeat(seq=seq + 1000)))
    while nxt is not None and nxt.HasField("release"):
        out.append(nxt.release)
        nxt = await stream.call.read()
    assert nxt is not None and nxt.HasField("heartbeat_ack"), nxt
    return out


async def test_a_node_over_its_budget_has_its_least_valuable_retention_released(
    daemon: Daemon, client: Client
) -> None:
    stream = await _attached(client)
    try:
        before = released("budget")
        # 100 blocks, a budget of half: 50; 60 held, so 10 must go: the least valuable (c-low).
        releases = await _heartbeat(daemon, stream, 1, 100, 0.6)
        assert [(r.conversation_id, r.reason) for r in releases] == [("c-low", "budget")]
        assert struct_to_dict(releases[0].kv_transfer_params) == {
            **d_params("d-1", 305, "c-low"),
            "remote_num_tokens": 0,
        }
        assert released("budget") == before + 1
        # Out of etcd before D was told: never handed out.
        answer = await client.leases.Lookup(lookup_request("c-low"), timeout=10)
        assert (answer.reason, answer.claimed) == ("no_lease", False)
        for kept in ("c-high", "c-small"):
            await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id=kept), timeout=10)
        # Under budget now: nothing more goes.
        assert await _heartbeat(daemon, stream, 2, 100, 0.6) == []
        listed = await client.nodes.List(nodes_pb2.ListNodesRequest(local_only=True), timeout=10)
        (node,) = listed.nodes
        assert (node.pool_blocks, node.retained_blocks) == (100, 40)
        assert node.pool_usage == pytest.approx(0.6)
        # A registration that takes it over again has the budget applied at once, before
        # the sidecar's next heartbeat: 40 + 11 blocks, over 50; the 11-block one, at
        # 14.5 tokens a block, is the least valuable.
        params = d_params("d-1", 160, "c-new")
        await client.leases.Register(lease_request("c-new", num_tokens=160, params=params), timeout=10)
        await client.leases.Register(
            lease_request("c-odd", num_tokens=161, params=d_params("d-1", 161, "c-odd")), timeout=10
        )
        pushed = await asyncio.wait_for(stream.call.read(), timeout=10)
        assert (pushed.release.conversation_id, pushed.release.reason) == ("c-odd", "budget")
    finally:
        await stream.close()


async def test_a_near_full_node_gets_room_from_retentions_first(
    make_daemon: DaemonFactory, etcd_endpoint: str, connect
) -> None:  # type: ignore[no-untyped-def]
    d = await make_daemon(replace(daemon_settings(etcd_endpoint), budget=Budget(1.0, 0.9)))
    client = connect(d)
    stream = await _attached(client)
    try:
        # No budget (1.0), but 92 of 100 blocks in use, the mark at 90: 2 blocks to free.
        releases = await _heartbeat(d, stream, 1, 100, 0.92)
        assert [(r.conversation_id, r.reason) for r in releases] == [("c-low", "near_full")]
        # D's metrics do not show those blocks free yet: they are not released for twice.
        assert await _heartbeat(d, stream, 2, 100, 0.92) == []
        assert await _heartbeat(d, stream, 3, 100, 0.5) == []
    finally:
        await stream.close()


async def test_a_retention_handed_out_is_never_released(
    make_daemon: DaemonFactory, etcd_endpoint: str, connect
) -> None:  # type: ignore[no-untyped-def]
    # No budget share (a registration starts no pass); near full: 2 blocks to free, the
    # least valuable retention (c-low) goes, as the index knows it.
    daemon = await make_daemon(replace(daemon_settings(etcd_endpoint), budget=Budget(1.0, 0.9)))
    client = connect(daemon)
    stream = await _attached(client)
    try:
        assert daemon.control_plane is not None
        budgets = daemon.control_plane.budgets
        stale = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="c-low"), timeout=10)
        pulled = await client.leases.Lookup(lookup_request("c-low", prompt_tokens=400), timeout=10)
        assert pulled.claimed
        # As a replica that did not see the claim knows it: still held.
        record = await daemon.control_plane.owned.read("default", "c-high")
        assert record[0] is not None
        low = msgspec.structs.replace(record[0].retention, num_tokens=305)
        budgets.registered("default", "c-low", low, stale.revision)
        assert await _heartbeat(daemon, stream, 1, 100, 0.92) == []  # its revoke found it gone
        # A turn's newer retention is not the one decided on either: it stays.
        await client.leases.Register(lease_request("c-low", num_tokens=305), timeout=10)
        budgets.registered("default", "c-low", low, stale.revision)
        assert await _heartbeat(daemon, stream, 2, 100, 0.92) == []
        again = await client.leases.Lookup(lookup_request("c-low", prompt_tokens=400), timeout=10)
        assert (again.reason, again.claimed) == ("pull", True)
    finally:
        await stream.close()


async def test_a_conversation_end_revokes_and_has_the_attached_sidecar_free_it(
    daemon: Daemon, client: Client
) -> None:
    stream = await _attached(client)
    try:
        before = released("conversation_end")
        ended = await client.leases.Revoke(
            leases_pb2.RevokeLeaseRequest(conversation_id="c-high", conversation_end=True), timeout=10
        )
        assert (ended.found, ended.released_by_node) == (True, True)
        assert not ended.HasField("release_params")  # D's sidecar frees them: nobody else
        # At once, not with the answer to the next heartbeat.
        pushed = await asyncio.wait_for(stream.call.read(), timeout=10)
        assert pushed.HasField("release"), pushed
        assert (pushed.release.conversation_id, pushed.release.reason) == ("c-high", "conversation_end")
        assert struct_to_dict(pushed.release.kv_transfer_params)["remote_num_tokens"] == 0
        assert await _heartbeat(daemon, stream, 1, 0, 0.0) == []  # (sent once)
        assert released("conversation_end") == before + 1
        answer = await client.leases.Lookup(lookup_request("c-high"), timeout=10)
        assert (answer.reason, answer.claimed) == ("no_lease", False)
        # Ending it again finds nothing.
        again = await client.leases.Revoke(
            leases_pb2.RevokeLeaseRequest(conversation_id="c-high", conversation_end=True), timeout=10
        )
        assert (again.found, again.released_by_node) == (False, False)
    finally:
        await stream.close()


async def test_a_conversation_end_on_a_node_attached_elsewhere_answers_the_release(
    daemon: Daemon, client: Client
) -> None:
    await client.nodes.Register(node_request("d-1"), timeout=10)
    await client.leases.Register(lease_request("c-1"), timeout=10)
    ended = await client.leases.Revoke(
        leases_pb2.RevokeLeaseRequest(conversation_id="c-1", conversation_end=True), timeout=10
    )
    assert (ended.found, ended.released_by_node) == (True, False)
    assert struct_to_dict(ended.release_params)["remote_num_tokens"] == 0


async def test_retentions_registered_through_another_replica_count_after_a_scan(
    make_daemon: DaemonFactory, etcd_endpoint: str, connect
) -> None:  # type: ignore[no-untyped-def]
    """The replica D's sidecar is attached to learns the retentions registered through
    another one (and forgets those claimed there) from its gauge scan."""
    a = await make_daemon(daemon_settings(etcd_endpoint, prefix="/t-budget-scan"))
    b = await make_daemon(daemon_settings(etcd_endpoint, prefix="/t-budget-scan"))
    ca, cb = connect(a), connect(b)
    await ca.nodes.Register(node_request("d-1"), timeout=10)
    stream = AttachStream(ca)
    try:
        await stream.send(hello("d-1"))
        for conversation, tokens in HELD.items():
            params = d_params("d-1", tokens, conversation)
            await cb.leases.Register(
                lease_request(conversation, num_tokens=tokens, params=params), timeout=10
            )
        assert a.control_plane is not None
        assert a.control_plane.budgets.retained_blocks("d-1") == 0  # (none went through it)
        await a.control_plane.gauges.scan()
        assert a.control_plane.budgets.retained_blocks("d-1") == 60
        pulled = await cb.leases.Lookup(lookup_request("c-small", prompt_tokens=400), timeout=10)
        assert pulled.claimed
        for replica in (a, b):  # the claim's writes, behind its answer, are in etcd
            assert replica.control_plane is not None
            await replica.control_plane.owners.writes.flush()
        await a.control_plane.gauges.scan()
        assert a.control_plane.budgets.retained_blocks("d-1") == 50
        releases = await _heartbeat(a, stream, 1, 80, 0.5)  # a budget of 40: c-low goes
        assert [(r.conversation_id, r.reason) for r in releases] == [("c-low", "budget")]
    finally:
        await stream.close()


async def test_a_lookup_and_a_release_racing_for_a_retention_never_both_get_it(
    daemon: Daemon, client: Client
) -> None:
    """Twenty conversations, each looked up and released at the same moment: each
    retention goes to exactly one of the two."""
    assert daemon.control_plane is not None
    store = daemon.control_plane.owned
    await client.nodes.Register(node_request("d-1"), timeout=10)
    names = [f"race-{i}" for i in range(20)]
    revisions = {}
    for name in names:
        registered = await client.leases.Register(lease_request(name, num_tokens=320), timeout=10)
        revisions[name] = registered.lease.revision

    async def both(name: str) -> tuple[bool, bool]:
        looked, released = await asyncio.gather(
            client.leases.Lookup(lookup_request(name, prompt_tokens=400), timeout=10),
            store.revoke_exact("default", name, revisions[name]),
        )
        return looked.claimed, released is not None

    outcomes = await asyncio.gather(*map(both, names))
    assert all(claimed != released for claimed, released in outcomes), outcomes


async def _idle(daemon: Daemon, names: list[str], age: float = 1000.0) -> None:
    """The daemon has seen MIN_OBSERVED turn intervals of 5 s, and takes the retentions of
    `names` (registered) as created `age` seconds ago, at their real revisions."""
    assert daemon.control_plane is not None
    budgets = daemon.control_plane.budgets
    for _ in range(MIN_OBSERVED):
        budgets.sketch.observe(5.0)
    for name in names:
        record, _ = await daemon.control_plane.owned.read("default", name)
        assert record is not None
        old = msgspec.structs.replace(record.retention, created_at=record.retention.created_at - age)
        budgets.registered("default", name, old, record.revision)


async def test_a_retention_idle_far_past_every_interval_seen_is_released(
    daemon: Daemon, client: Client
) -> None:
    stream = await _attached(client)
    try:
        before = released("idle")
        # Well within the budget (60 of 1,000 blocks); c-high idle 1,000 s, where every
        # conversation seen came back within 5 s; the others just registered.
        await _idle(daemon, ["c-high"])
        releases = await _heartbeat(daemon, stream, 1, 1000, 0.1)
        assert [(r.conversation_id, r.reason) for r in releases] == [("c-high", "idle")]
        assert struct_to_dict(releases[0].kv_transfer_params)["remote_num_tokens"] == 0
        assert released("idle") == before + 1
        answer = await client.leases.Lookup(lookup_request("c-high"), timeout=10)
        assert (answer.reason, answer.claimed) == ("no_lease", False)  # out of etcd first
        assert await _heartbeat(daemon, stream, 2, 1000, 0.1) == []  # (the others are fresh)
    finally:
        await stream.close()


async def test_with_idle_release_off_an_idle_retention_is_held(
    make_daemon: DaemonFactory, etcd_endpoint: str, connect
) -> None:  # type: ignore[no-untyped-def]
    d = await make_daemon(replace(daemon_settings(etcd_endpoint), budget=Budget(0.5, 0.9, 0.0)))
    client = connect(d)
    stream = await _attached(client)
    try:
        await _idle(d, list(HELD))
        assert await _heartbeat(d, stream, 1, 1000, 0.1) == []  # --idle-release 0: the fixed TTL
        pulled = await client.leases.Lookup(lookup_request("c-high", prompt_tokens=600), timeout=10)
        assert (pulled.reason, pulled.claimed) == ("pull", True)
    finally:
        await stream.close()


async def test_a_lookup_and_an_idle_release_racing_never_both_get_it(daemon: Daemon, client: Client) -> None:
    """Twenty idle conversations, each looked up while a budget pass releases them all:
    each retention goes to exactly one of the two."""
    assert daemon.control_plane is not None
    budgets = daemon.control_plane.budgets
    await client.nodes.Register(node_request("d-1"), timeout=10)
    names = [f"idle-race-{i}" for i in range(20)]
    for name in names:
        await client.leases.Register(lease_request(name, num_tokens=320), timeout=10)
    await _idle(daemon, names)
    budgets.attached("d-1", lambda: None)  # (its sidecar's stream is held here: releases go on it)
    assert budgets.begin("d-1")
    _, *looked = await asyncio.gather(
        budgets.report("d-1", Pool(1000, 0.1)),
        *(client.leases.Lookup(lookup_request(n, prompt_tokens=400), timeout=10) for n in names),
    )
    sent = budgets.take_releases("d-1")
    assert {r.reason for r in sent} <= {Reason.IDLE}
    freed = {r.conversation_id for r in sent}
    outcomes = {n: (answer.claimed, n in freed) for n, answer in zip(names, looked, strict=True)}
    assert all(claimed != was_freed for claimed, was_freed in outcomes.values()), outcomes
    assert freed  # (the pass did release some: a race, not a pass that found nothing)

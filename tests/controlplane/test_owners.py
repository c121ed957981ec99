"""Claims decided in memory by shard owners (controlplane.owners), on real daemons and a
real etcd: answered without etcd, stopped past the owner's validity, fenced against a
deposed owner, an unclean takeover spending what it finds, a clean one keeping it, and
operations forwarded between replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from controlplane import metrics
from controlplane.budget import Reason
from controlplane.daemon import Daemon
from controlplane.errors import StoreUnavailable
from controlplane.owners import OwnerStore
from controlplane.owners.durable import Deposed
from controlplane.owners.memory import Conversation, Target, Write
from controlplane.records import OwnerRecord, ShardState
from controlplane.settings import OwnerSettings
from controlplane.store import EtcdStore
from kvferry.shards import shard_of
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client, DaemonFactory, EtcdProcess, daemon_settings, owning
from tests.controlplane.test_claims_and_nodes import AttachStream, hello
from tests.factories import beside_other_replicas, lease_request, lookup_request, node_reads, node_request
from tests.polling import eventually

Connect = Callable[[Daemon], Client]


async def test_the_owner_claims_from_memory_while_etcd_is_paused_then_stops_past_its_validity(
    private_etcd: EtcdProcess, make_daemon: DaemonFactory, connect: Connect
) -> None:
    # validity ends at most 4 s after the last keep-alive etcd acknowledged; the lease, 10 s
    d = await make_daemon(owning(daemon_settings(private_etcd.endpoint), ttl_s=10, margin_s=6.0))
    c = connect(d)
    await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=30))
    for name in ("p0", "p1"):
        await c.leases.Register(lease_request(name))
    assert d.control_plane is not None
    owned, owners = d.control_plane.owned, d.control_plane.owners
    pid = private_etcd.etcd.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        got = await owned.claim("default", "p0", time.time(), "turn-2")
        assert got.taken is not None and time.monotonic() - started < 1.0  # (no etcd round trip)
        again = await owned.claim("default", "p0", time.time(), "turn-2b")
        assert again.taken is None and again.earlier is not None and again.earlier.claimed_by == "turn-2"
        at_once = owned.claim_now("default", "p0", time.time(), "turn-2c")  # (the lookups' way)
        assert at_once is not None and at_once.taken is None and at_once.earlier == again.earlier

        async def lapsed() -> bool:
            return not owners.valid()

        await eventually(lapsed, within=10)
        # the claim decided at once (no task) is not made past the validity either: it
        # takes nothing and leaves the claim to the path that waits for etcd
        assert owned.claim_now("default", "p1", time.time(), "turn-3") is None
        with pytest.raises(StoreUnavailable, match="ownership not confirmed by etcd"):
            await owned.claim("default", "p1", time.time(), "turn-3")
    finally:
        os.kill(pid, signal.SIGCONT)

    async def decided() -> bool:  # (the lease outlived the pause: the same memory goes on)
        try:
            return (await owned.claim("default", "p1", time.time(), "turn-3")).taken is not None
        except StoreUnavailable:
            return False

    await eventually(decided, within=10)
    assert d.control_plane is not None

    async def durable() -> bool:  # the claims' writes reached etcd behind their answers
        etcd = d.control_plane.store.retentions  # type: ignore[union-attr]
        return all([(await etcd.read("default", n))[0] is None for n in ("p0", "p1")])

    await eventually(durable, within=10)


async def test_a_deposed_owners_writes_are_refused_by_the_fence(store: EtcdStore) -> None:
    owners = OwnerStore(store.kv, store.keys, store.gc, 4, lambda _: None)
    lease_a, lease_b = await owners.grant(30), await owners.grant(30)
    a = await owners.take(0, lease_a, OwnerRecord("a"))
    assert a is not None and a.previous is None
    assert await owners.take(0, lease_b, OwnerRecord("b")) is None  # (owned)
    await owners.revoke_lease(lease_a)  # a's lease lapsed: its owner key went with it
    b = await owners.take(0, lease_b, OwnerRecord("b"))
    assert b is not None and b.previous == ShardState(clean=False, replica="a")
    write = [Write(Target.RETENTION, Conversation("t", "c"), None)]
    with pytest.raises(Deposed) as e:
        await owners.write({0: a.fence}, write, time.time())
    assert e.value.shards == {0}
    assert await owners.write({0: b.fence}, write, time.time()) >= b.fence
    assert await owners.hand_over({0: a.fence}, OwnerRecord("a")) == set()
    assert await owners.hand_over({0: b.fence}, OwnerRecord("b")) == {0}
    c = await owners.take(0, await owners.grant(30), OwnerRecord("c"))
    assert c is not None and c.previous == ShardState(clean=True, replica="b", fence=b.fence)


async def test_an_unclean_takeover_spends_every_retention_it_finds_and_releases_it(
    etcd_endpoint: str, make_daemon: DaemonFactory, connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = owning(daemon_settings(etcd_endpoint), ttl_s=2, grace_s=0.3)
    first = await make_daemon(settings)
    ca = connect(first)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60))
    await ca.leases.Register(lease_request("kept-by-a"))
    assert first.control_plane is not None

    async def unreachable(*_: object, **__: object) -> int:
        raise StoreUnavailable("etcd: partitioned away")

    # a loses etcd: no keep-alive reaches it, nor any write (it stops deciding on its own)
    monkeypatch.setattr(first.control_plane.owners.store, "refresh", unreachable)
    monkeypatch.setattr(first.control_plane.owners.store, "write", unreachable)
    spent_before = metrics.FAILOVER_RETENTIONS._value.get()
    owners_a = first.control_plane.owners

    async def lapsed() -> bool:  # (until then a may still hand it out from memory: rightly)
        return not owners_a.valid()

    await eventually(lapsed, within=10)
    second = await make_daemon(settings)
    cb = connect(second)
    assert second.control_plane is not None

    async def taken_over() -> bool:
        answer = await cb.leases.Lookup(lookup_request("kept-by-a"), timeout=10)
        return answer.reason != "store_unavailable"

    await eventually(taken_over, within=20)
    answer = await cb.leases.Lookup(lookup_request("kept-by-a"), timeout=10)
    assert (answer.decision, answer.reason) == (leases_pb2.RECOMPUTE, "no_lease")  # never handed out
    assert metrics.FAILOVER_RETENTIONS._value.get() - spent_before >= 1
    relay = second.control_plane.budgets.relay

    async def released() -> bool:  # (d-1 is attached nowhere: held until it is)
        return relay.held >= 1

    await eventually(released, within=10)
    stream = AttachStream(cb)
    try:
        first_answer = await stream.send(hello("d-1"))
        assert first_answer is not None and first_answer.HasField("attached")
        pushed = await asyncio.wait_for(stream.call.read(), 10)
        assert isinstance(pushed, nodes_pb2.AttachResponse) and pushed.HasField("release"), pushed
        assert (pushed.release.conversation_id, pushed.release.reason) == ("kept-by-a", Reason.FAILOVER.value)
    finally:
        await stream.close()
    # and a, past its validity, decides nothing any more
    gone = await ca.leases.Lookup(lookup_request("kept-by-a"), timeout=10)
    assert gone.reason == "store_unavailable" and not gone.claimed


async def test_a_clean_handover_keeps_the_retentions(make_daemon: DaemonFactory, connect: Connect) -> None:
    first = await make_daemon()
    ca = connect(first)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60))
    names = [f"keep-{i}" for i in range(8)]
    for name in names:
        await ca.leases.Register(lease_request(name))
    second = await make_daemon(first.settings)
    cb = connect(second)
    await first.stop()  # (SIGTERM's path: every shard flushed and handed over)
    answers = await asyncio.gather(*(cb.leases.Lookup(lookup_request(n), timeout=10) for n in names))
    assert [a.decision for a in answers] == [leases_pb2.PULL] * len(names), answers


async def test_a_replica_that_joins_takes_its_share_with_no_operation_asking(
    make_daemon: DaemonFactory,
) -> None:
    """The first hands half the shards over; the second takes them by its own balance pass
    (before, a replica that had never owned a shard had no ownership lease, never balanced,
    and took a shard only when an operation reached it: the first took the free shards back
    as their lookups came, and handed them over again)."""
    first = await make_daemon()
    second = await make_daemon(first.settings)
    assert first.control_plane is not None and second.control_plane is not None
    half = OwnerSettings().shards // 2
    await eventually(lambda: len(second.control_plane.owners.shards) == half, within=30)  # type: ignore[union-attr]
    assert len(first.control_plane.owners.shards) == half


async def test_replicas_forward_to_the_owner_and_hand_each_retention_out_once(
    make_daemon: DaemonFactory, connect: Connect
) -> None:
    first = await make_daemon()
    second = await make_daemon(first.settings)
    ca, cb = connect(first), connect(second)
    await ca.nodes.Register(node_request("d-1", liveness_ttl_seconds=60))
    names = [f"race-{i}" for i in range(24)]
    for i, name in enumerate(names):
        await (ca if i % 2 else cb).leases.Register(lease_request(name))
    assert first.control_plane is not None and second.control_plane is not None
    forwarded = sum(s.get() for s in _forwarded())

    async def both(name: str) -> list[bool]:
        looked = await asyncio.gather(
            ca.leases.Lookup(lookup_request(name), timeout=10),
            cb.leases.Lookup(lookup_request(name), timeout=10),
        )
        return [x.claimed for x in looked]

    outcomes = await asyncio.gather(*map(both, names))
    assert all(sum(o) == 1 for o in outcomes), outcomes  # each exactly once
    assert sum(s.get() for s in _forwarded()) > forwarded  # (a replica without the shard asked its owner)
    owners = first.control_plane.owners.shards.keys() | second.control_plane.owners.shards.keys()
    assert {shard_of("default", n, OwnerSettings().shards) for n in names} <= owners


def _forwarded() -> list[Any]:
    return [child._value for child in metrics.FORWARDED._metrics.values()]  # type: ignore[attr-defined]


async def test_a_looked_up_node_is_kept_confirmed_between_lookups(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The confirming read a pull waits for (1-3 ms of etcd on a turn after a quiet moment)
    is kept fresh in the background while the node is looked up, and no longer after."""
    from controlplane.service import nodecache

    monkeypatch.setattr(nodecache, "KEEP_S", 1.0)
    beside_other_replicas(monkeypatch, daemon)
    cp = daemon.control_plane
    assert cp is not None
    await client.nodes.Register(node_request("d-1", liveness_ttl_seconds=60))
    await client.leases.Register(lease_request("kept"))
    assert (await client.leases.Lookup(lookup_request("kept"), timeout=10)).decision == leases_pb2.PULL
    after_lookup = node_reads()

    async def read_meanwhile() -> bool:  # (two ranges a read)
        return node_reads() - after_lookup >= 2 * 3

    await eventually(read_meanwhile)

    async def let_go() -> bool:
        return "d-1" not in cp.nodes._looked_up

    await eventually(let_go)


async def test_lookups_of_one_node_share_its_confirming_read(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull is confirmed on the node as etcd had it at most CONFIRM_S ago: concurrent
    lookups of one decode node share one read (they were two etcd requests each)."""
    beside_other_replicas(monkeypatch, daemon)
    await client.nodes.Register(node_request("d-1", liveness_ttl_seconds=60))
    names = [f"many-{i}" for i in range(20)]
    for name in names:
        await client.leases.Register(lease_request(name))
    before = node_reads()
    answers = await asyncio.gather(*(client.leases.Lookup(lookup_request(n), timeout=10) for n in names))
    assert [a.decision for a in answers] == [leases_pb2.PULL] * len(names)
    counted = node_reads() - before
    assert 1 <= counted <= 2 * 10, counted  # (two ranges a read: 40 unshared; one, or a few if slow)


async def test_a_claim_made_at_once_shows_what_it_would_take_and_takes_nothing_when_refused(
    daemon: Daemon, client: Client
) -> None:
    """OwnedRetentions.claim_now's `accept` (the lookups decide on it before claiming): it is
    shown the retention the claim would take, or the marker it would find; refused, nothing
    is taken and nothing is written."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("p"))
    assert daemon.control_plane is not None
    owned = daemon.control_plane.owned
    shown: list[tuple[object, object]] = []

    def refuse(retention: object, earlier: object) -> bool:
        shown.append((retention, earlier))
        return False

    assert owned.claim_now("default", "p", time.time(), "turn-2", refuse) is None
    ((retention, earlier),) = shown
    assert getattr(retention, "engine_id", None) == "d-1" and earlier is None
    stored, marker = await owned.read("default", "p")
    assert stored is not None and stored.retention == retention and marker is None  # (still there)
    taken = owned.claim_now("default", "p", time.time(), "turn-2", lambda r, c: True)
    assert taken is not None and taken.taken == retention
    assert owned.claim_now("default", "p", time.time(), "turn-3", refuse) is None
    assert shown[-1][0] is None and getattr(shown[-1][1], "claimed_by", None) == "turn-2"


async def test_a_take_whose_answer_was_lost_is_released_and_taken_again(
    etcd_endpoint: str, make_daemon: DaemonFactory, connect: Connect
) -> None:
    """etcd applied a take whose answer the replica never got: etcd has the shard as the
    replica's, on its lease kept alive, and the replica does not hold it. Every operation
    on it found this replica the owner and waited in vain, for good; the balance pass now
    frees it (its state unclean, as the take left it), and the shard is taken again."""
    d = await make_daemon(owning(daemon_settings(etcd_endpoint), balance_s=3600.0))
    assert d.control_plane is not None
    owners = d.control_plane.owners
    await eventually(lambda: len(owners.shards) == 32)
    await owners.hand_over(0)
    assert await owners.store.take(0, owners._lease, owners.me) is not None  # (its answer "lost")
    assert 0 not in owners.shards
    c = connect(d)
    await c.nodes.Register(node_request("d-1", liveness_ttl_seconds=60), timeout=10)
    name = next(n for n in (f"stray-{i}" for i in range(1000)) if shard_of("default", n, 32) == 0)
    with pytest.raises(grpc.aio.AioRpcError) as stuck:
        await c.leases.Register(lease_request(name), timeout=10)
    assert stuck.value.code() == grpc.StatusCode.ABORTED  # (not applied: nobody holds the shard)
    await owners.balance()  # (a pass of its loop)
    assert 0 in owners.shards
    await c.leases.Register(lease_request(name), timeout=10)

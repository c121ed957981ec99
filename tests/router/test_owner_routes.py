"""The router sends each lookup to the daemon replica owning its conversation's claim
shard (router.routes, Leases/Routes), not through the replica it is configured with,
which would forward it: the map alone, then two real replicas on a real etcd."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc
from prometheus_client import REGISTRY

from controlplane.daemon import Daemon
from kvferry.shards import shard_of
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from realvllm.process import free_port
from router.daemon_client import DaemonClient
from router.replica import Replica
from router.routes import SHUN_S, Owner, OwnerReplicas, ShardRoutes, routes_of
from router.settings import DaemonSettings
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.factories import lease_request, node_request
from tests.polling import eventually


def _response(shards: int, *owners: tuple[str, str, list[int]]) -> leases_pb2.RoutesResponse:
    res = leases_pb2.RoutesResponse(shards=shards)
    for i, (address, stream, owned) in enumerate(owners):
        res.owners.add(replica=f"r{i}", address=address, stream_address=stream, shards=owned)
    return res


def test_a_conversation_goes_to_the_owner_of_its_shard_as_the_daemons_compute_it() -> None:
    res = _response(4, ("a:1", "a:2", [0, 1]), ("b:1", "", [2, 3, 9]))  # (9: past the count)
    framed = routes_of(res, framed=True)
    assert framed.owners == {0: Owner("a:1", "a:2"), 1: Owner("a:1", "a:2")}  # (b serves no framed stream)
    plain = routes_of(res, framed=False)
    assert plain.owners == {0: Owner("a:1"), 1: Owner("a:1"), 2: Owner("b:1"), 3: Owner("b:1")}
    for conversation in (f"c-{i}" for i in range(20)):
        # ("" is the default tenant, as the daemon computes the shard)
        want = plain.owners[shard_of("default", conversation, 4)]
        assert plain.owner("", conversation) == plain.owner("default", conversation) == want
    assert ShardRoutes().owner("", "c") is None  # (no routes learned: the replica in use)


def test_owner_replicas_are_made_once_retired_when_gone_and_shunned_a_while() -> None:
    now = [0.0]
    made: list[Owner] = []

    def make(owner: Owner) -> Replica:
        made.append(owner)
        return object()  # type: ignore[return-value]  # (a stand-in: only identity matters)

    replicas = OwnerReplicas(make, clock=lambda: now[0])
    first, gone = replicas.learn(routes_of(_response(1, ("a:1", "", [0])), framed=False))
    assert (len(first), gone, made) == (1, [], [Owner("a:1")])
    assert replicas.replica("", "c") is first[0]
    again, gone = replicas.learn(routes_of(_response(1, ("a:1", "", [0])), framed=False))
    assert (again, gone) == ([], [])  # (the same owner: the same replica, its stream kept)
    replicas.shun("a:1")
    assert replicas.replica("", "c") is None  # (failed: its lookups go to the replica in use)
    now[0] += SHUN_S
    assert replicas.replica("", "c") is first[0]
    moved, gone = replicas.learn(routes_of(_response(1, ("b:1", "", [0])), framed=False))
    assert gone == first and replicas.replica("", "c") is moved[0]


def _claims_forwarded() -> float:
    """Claims forwarded between the replicas. (Not the peeks that set each lookup stream up:
    their conversation's owner is one of the replicas, and the other forwards them.)"""
    return REGISTRY.get_sample_value("kvferry_owner_forwarded_total", {"op": "claim"}) or 0.0


async def _two_replicas(make_daemon: DaemonFactory, etcd_endpoint: str) -> tuple[Daemon, Daemon]:
    settings = daemon_settings(etcd_endpoint)
    settings = replace(settings, server=replace(settings.server, stream_listen="127.0.0.1:0"))
    first = await make_daemon(settings)
    second = await make_daemon(settings)
    for d in (first, second):  # (each owns its half: balanced)
        assert d.control_plane is not None
        await eventually(lambda d=d: len(d.control_plane.owners.shards) == 16, within=30)  # type: ignore[union-attr]
    return first, second


async def test_lookups_go_to_their_owner_and_none_is_forwarded(
    make_daemon: DaemonFactory, etcd_endpoint: str
) -> None:
    first, second = await _two_replicas(make_daemon, etcd_endpoint)
    assert first.control_plane is not None and second.control_plane is not None
    admin = Client(first.address)
    await admin.nodes.Register(node_request("d-1", liveness_ttl_seconds=60), timeout=10)
    names = [f"routed-{i}" for i in range(24)]
    for name in names:
        await admin.leases.Register(lease_request(name), timeout=10)
    settings = DaemonSettings(
        addresses=(first.address,),
        stream_addresses=(f"127.0.0.1:{first.stream_port}",),
        lookup_deadline_s=5.0,
        lookup_max_wait_s=5.0,
    )
    client = DaemonClient(settings.addresses, settings)
    try:
        await client.refresh_routes()
        owned_by_second = set(second.control_plane.owners.shards)
        on_second = [n for n in names if shard_of("default", n, 32) in owned_by_second]
        assert on_second and len(on_second) < len(names)  # (the test's names span both)
        for name in names:
            replica = client.owners.replica("", name)
            want = second if name in on_second else first
            assert replica is not None and replica.stream_address == f"127.0.0.1:{want.stream_port}"
        before = _claims_forwarded()
        prompt: asyncio.Future[tuple[list[int], bytes] | None] = asyncio.get_running_loop().create_future()
        prompt.set_result(([1] * 32, b""))
        for name in names:
            reuse = await client.lookup_early("", name, prompt)
            assert reuse.decision != "SKIPPED", reuse  # (answered by the owner)
        assert _claims_forwarded() == before  # (each decided where it arrived: no hop between daemons)
        taken = await admin.leases.Get(leases_pb2.GetLeaseRequest(conversation_id=on_second[0]), timeout=10)
        assert taken.claimed  # (claimed at the owner: the retention is spent, single use)
    finally:
        await client.close()
        await admin.channel.close()


class _RoutesOnly(leases_pb2_grpc.LeasesServicer):
    """A daemon that answers Leases/Routes with `routes` (None: as one without the RPC)."""

    def __init__(self, routes: leases_pb2.RoutesResponse | None) -> None:
        self.routes = routes

    async def Routes(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if self.routes is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return self.routes


async def _serve(servicer: _RoutesOnly) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    leases_pb2_grpc.add_LeasesServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_an_owner_that_cannot_be_reached_is_left_out_and_routes_stop_with_the_rpc() -> None:
    """An owner whose stream cannot be set up is shunned before a turn's lookup fails on it;
    a daemon without Leases/Routes (an older one, failed over to) turns routing off, and
    the routes learned before go with it: not a map frozen as it was."""
    gone = f"127.0.0.1:{free_port()}"  # (nothing listens there)
    servicer = _RoutesOnly(_response(2, (gone, "", [0, 1])))
    server, address = await _serve(servicer)
    client = DaemonClient([address], DaemonSettings(addresses=(address,), rpc_timeout_s=2.0))
    try:
        await client.refresh_routes()
        assert client.owners.routes.owners  # (learned)
        await eventually(lambda: client.owners.replica("", "c") is None, within=20)  # (shunned)
        [owner] = client.owners.all()
        servicer.routes = None
        await client.refresh_routes()
        assert client.owners.all() == [] and client.owners.routes == ShardRoutes()
        assert owner in client._retired  # (closed once the calls on it are over)
        servicer.routes = _response(2, (gone, "", [0, 1]))
        await client.refresh_routes()  # (off: not asked again)
        assert client.owners.all() == []
    finally:
        await client.close()
        await server.stop(None)

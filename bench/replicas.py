"""A second daemon replica beside the one a benchmark measures (bench.fsync_tail): started
on the same etcd, or only announced with no address (as a replica without --advertise is),
and lookups sent to each conversation's owner replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from aetcd import rpc

from bench.daemon_workload import DaemonProcess, metrics_page
from controlplane.etcd import Client as EtcdClient
from controlplane.owners import OwnerSettings
from controlplane.records import Keys
from controlplane.settings import EtcdSettings
from kvferry.framedstream import opener
from kvferry.leaseclient import LeaseStream
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from router.routes import routes_of

Route = Callable[[str], LeaseStream]
"""The stream a conversation's lookup goes to."""
TENANT = "bench"  # (bench.daemon_workload.lookup's)


async def beside_a_replica(etcd: str, d: DaemonProcess) -> DaemonProcess:
    """Start an idle second daemon replica on etcd `etcd`, and wait until it owns half of the
    claim shards (lookups of those that reach `d` are forwarded to it) and `d` holds its
    promise of notice and decides pulls on its own view again (controlplane.notices)."""
    other = DaemonProcess(etcd=etcd)
    await other.start()
    half = OwnerSettings().shards // 2
    for replica in (d, other):  # (the shards handed over: no lookup waits on a takeover)
        await metric_reads(replica, f"kvferry_owned_shards {half:.1f}")
    await metric_reads(other, "kvferry_node_notice_promises 1.0")
    await metric_reads(d, "kvferry_node_view_sole 1.0")
    return other


async def beside_an_unreachable_replica(etcd: str, d: DaemonProcess) -> EtcdClient:
    """Announce a replica with no address beside `d` (as peers.py does for one without
    --advertise): it cannot be asked for a promise of notice, so `d` confirms its pulls by
    reads. Wait until it does. -> the client holding the announcement's lease."""
    raw = EtcdClient((etcd,), 5.0)
    await raw.connect()
    lease = await raw.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=600))
    key = Keys(EtcdSettings().prefix).replica("bench-other")
    await raw.kvstub.Put(rpc.PutRequest(key=key, value=b"", lease=lease.ID))
    await metric_reads(d, "kvferry_node_view_sole 0.0")
    return raw


@contextlib.asynccontextmanager
async def at_owners(daemons: list[DaemonProcess]) -> AsyncIterator[Route]:
    """A framed stream to each of `daemons`, and the route of a conversation's lookup to its
    shard's owner as a router learns it (Leases/Routes, router.routes: no forwarding hop).
    The owners stay put while nobody joins or leaves; a shard with none goes to the first."""
    channel = grpc.aio.insecure_channel(daemons[0].address)
    try:
        res = await leases_pb2_grpc.LeasesStub(channel).Routes(leases_pb2.RoutesRequest(), timeout=10)
    finally:
        await channel.close(None)
    routes = routes_of(res, framed=True)
    streams = {d.stream_address: LeaseStream(None, opener=opener(d.stream_address)) for d in daemons}
    first = streams[daemons[0].stream_address]

    def route(conversation_id: str) -> LeaseStream:
        owner = routes.owner(TENANT, conversation_id)
        return first if owner is None else streams.get(owner.stream_address, first)

    try:
        yield route
    finally:
        for stream in streams.values():
            await stream.close()


async def metric_reads(d: DaemonProcess, line: str, within_s: float = 60.0) -> None:
    """Wait until `d`'s /metrics page has `line`."""
    async with asyncio.timeout(within_s):
        while line not in metrics_page(d.metrics_address):  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.2)

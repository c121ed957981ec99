"""The daemon's gRPC surface: thin servicers that translate a message, call one domain
operation and build the reply. Nothing else lives here.

- nodes.py, leases.py: the servicers of kvferry.v1.Nodes and kvferry.v1.Leases;
- owners.py: kvferry.v1.Owners, the daemon-only forwarding to a shard's owner;
- auth.py: who calls, and whether its role may (one interceptor; per-request checks);
- stream.py: Leases/Stream's ops multiplexed on one stream;
- framed.py: the same ops on --stream-listen, framed without gRPC (kvferry.framedstream);
- status.py: the one map from domain errors to gRPC status codes;
- decoding.py: INVALID_ARGUMENT for a request that does not decode.

The message mappings are controlplane.messages; answers merged over every replica,
controlplane.cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from controlplane.cluster import Cluster
from controlplane.peers import Peers
from controlplane.server.auth import Authenticator
from controlplane.server.decoding import DecodeGuard
from controlplane.server.leases import LeasesServicer
from controlplane.server.nodes import NodesServicer
from controlplane.server.owners import OwnersServicer
from controlplane.service import ControlPlane
from kvferry.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from kvferry.security.policy import Policy
from kvferry.security.tls import TlsFiles, grpc_server_credentials
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc, owners_pb2, owners_pb2_grpc

SERVICE_NAMES = (
    leases_pb2.DESCRIPTOR.services_by_name["Leases"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["Nodes"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    owners_pb2.DESCRIPTOR.services_by_name["Owners"].full_name,
    reflection.SERVICE_NAME,
)


@dataclass(frozen=True)
class Access:
    """How the server lets callers in: TLS (None: plaintext), the policy (None: everyone is
    the development admin), and the optional TLS port for bearer tokens."""

    tls: TlsFiles | None = None
    policy: Policy | None = None
    token_listen: str = ""


@dataclass
class Serving:
    """A started server: its bound ports and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: HealthServicer
    leases: LeasesServicer
    token_port: int = 0


async def start_server(
    cp: ControlPlane,
    listen: str,
    max_message_bytes: int,
    peers: Peers | None = None,
    access: Access | None = None,
) -> Serving:
    """Build and start the gRPC server (Nodes/List and Nodes/Score ask `peers` too)."""
    access = access or Access()
    server = grpc.aio.server(
        interceptors=[Authenticator(access.policy), DecodeGuard()],
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
    leases = LeasesServicer(cp.retentions, cp.lookups, cp.held, cp.owned)
    leases_pb2_grpc.add_LeasesServicer_to_server(leases, server)
    owners_pb2_grpc.add_OwnersServicer_to_server(
        OwnersServicer(cp.owned, cp.budgets, cp.nodes, cp.store), server
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    # The main port requires client certificates (mTLS); the token port asks for none.
    port = _bind(server, listen, access.tls, require_client_cert=True)
    token_port = _bind(server, access.token_listen, access.tls, False) if access.token_listen else 0
    await server.start()
    for name in ("", *SERVICE_NAMES[:2]):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Serving(server, port, health, leases, token_port)


def _bind(server: grpc.aio.Server, listen: str, tls: TlsFiles | None, require_client_cert: bool) -> int:
    """Add a port on `listen` (TLS when `tls`). -> the bound port."""
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, grpc_server_credentials(tls, require_client_cert))
    except RuntimeError as e:  # grpc's way of saying the address is taken or bad
        raise OSError(f"cannot listen on {listen}: {e}") from e
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return port

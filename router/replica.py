"""One daemon replica as the router reaches it: its channel, its lookup stream (framed
when it serves one) and its Nodes and Leases stubs."""

from __future__ import annotations

from kvferry.channels import daemon_channel, daemon_channel_options
from kvferry.framedstream import opener
from kvferry.leaseclient import LeaseStream
from kvferry.security.tls import TlsFiles
from kvferry.v1 import leases_pb2_grpc, nodes_pb2_grpc

CHANNEL_OPTIONS = daemon_channel_options(max_backoff_ms=1000)


class Replica:
    """One daemon replica: its channel, its lookup stream and its Nodes stub."""

    def __init__(
        self, address: str, late_answer_s: float, tls: TlsFiles | None = None, stream_address: str = ""
    ) -> None:
        self.address = address
        self.stream_address = stream_address
        self.channel = daemon_channel(address, tls, CHANNEL_OPTIONS)
        framed = opener(stream_address, tls) if stream_address else None
        self.stream = LeaseStream(self.channel, late_answer_s, framed)
        """Its ``Leases/Stream``, which the lookups go over (framed, at `stream_address`)."""
        self.nodes = nodes_pb2_grpc.NodesStub(self.channel)
        self.leases = leases_pb2_grpc.LeasesStub(self.channel)
        self.late = 0
        """Lookups in a row it answered after their deadline (or never), each sent after the
        one before was found late (those that were out together count once)."""
        self.late_at = 0.0
        """When the last late one was found (time.monotonic())."""

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close(None)

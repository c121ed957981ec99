"""Leases/Stream's ops on the daemon's --stream-listen address: the same ops, results and
checks as the gRPC method (stream.py's OpStream, the Leases servicer's handlers), on a
plain connection framed as kvferry.framedstream says, without gRPC Python's cost per
message.

Who may call is decided as for gRPC (auth.admission, for the method
/kvferry.v1.Leases/Stream): the bearer token in the client's StreamHello, else its
verified client certificate; with TLS the listener requires a client certificate, as the
gRPC main port does. A refused hello gets the end status (UNAUTHENTICATED or
PERMISSION_DENIED, and the audit line); a frame that is too long or does not decode ends
the stream with INVALID_ARGUMENT once the ops in flight are answered, as a gRPC request
that does not decode does. A connection that closes without the client's done-writing
frame is a cancelled call: its ops in flight are cancelled (their claims put back).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import grpc
import structlog
from google.protobuf.message import DecodeError

from controlplane.errors import InvalidArgument
from controlplane.server.auth import admission, status_code
from controlplane.server.leases import LeasesServicer
from controlplane.server.status import status_of
from kvferry.framedstream import WELCOME, FrameError, end_frame, frame, read_frame
from kvferry.security.policy import Policy
from kvferry.security.tls import bearer_token, peer_identity_from_transport
from kvferry.tasks import cancel_and_wait
from kvferry.urls import join_host_port
from kvferry.v1 import leases_pb2

log = structlog.get_logger(__name__)

METHOD = "/kvferry.v1.Leases/Stream"
HELLO_TIMEOUT_S = 10.0
"""How long a new connection has to send its StreamHello."""


class _Gone(Exception):
    """The client closed its connection without ending its writing: a cancelled call."""


class FramedStreams:
    """The --stream-listen listener and its connections."""

    def __init__(self, leases: LeasesServicer, policy: Policy | None, max_bytes: int) -> None:
        self._leases = leases
        self._policy = policy
        self._max_bytes = max_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen on host:port (port 0: any). -> the bound port."""
        self._server = await asyncio.start_server(
            self._connection, host or None, port, ssl=ssl_context, limit=2**20
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening; every stream ends UNAVAILABLE, its ops in flight cancelled."""
        if self._server is not None:
            self._server.close()
        await cancel_and_wait(list(self._connections))

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = _peer(writer)
        try:
            await self._stream(reader, writer, peer)
            await writer.drain()
        except asyncio.CancelledError:
            writer.write(end_frame(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping"))
            raise
        except (_Gone, OSError):
            pass  # (nobody to tell)
        except Exception:  # a defect: logged, the connection closed, the listener goes on
            log.exception("stream.framed.error", peer=peer)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        """Admit the caller (its hello), then run its ops until it is done writing."""
        refusal = await self._admit(reader, writer, peer)
        if refusal is not None:
            writer.write(refusal)
            return
        writer.write(WELCOME)
        try:
            async for batch in self._leases.op_stream().serve(self._requests(reader)):
                writer.write(frame(batch))
                await writer.drain()
        except InvalidArgument as e:
            writer.write(end_frame(*status_of(e, "Leases/Stream")))

    async def _admit(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> bytes | None:
        """None once the caller is admitted (set for this task and the ops it starts);
        else the end frame that refuses it."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                payload = await read_frame(reader, self._max_bytes)
            if payload is None:
                raise _Gone
            hello = leases_pb2.StreamHello.FromString(payload)
        except TimeoutError:
            return end_frame(grpc.StatusCode.INVALID_ARGUMENT, f"no StreamHello within {HELLO_TIMEOUT_S:g} s")
        except (FrameError, DecodeError) as e:
            return end_frame(grpc.StatusCode.INVALID_ARGUMENT, f"the first frame is no StreamHello: {e}")
        token = bearer_token(hello.authorization)
        common_name = peer_identity_from_transport(writer.transport)
        denial = admission(self._policy, METHOD, token, common_name, peer)
        return None if denial is None else end_frame(status_code(denial), denial.message)

    async def _requests(self, reader: asyncio.StreamReader) -> AsyncIterator[leases_pb2.LeaseOpBatch]:
        """The client's op batches until its done-writing frame (_Gone: the connection ended
        without it; InvalidArgument: a frame that breaks the framing or does not decode)."""
        while True:
            try:
                payload = await read_frame(reader, self._max_bytes)
            except FrameError as e:
                raise InvalidArgument(f"Leases/Stream (framed): {e}") from None
            if payload is None:
                raise _Gone
            if not payload:
                return
            try:
                batch = leases_pb2.LeaseOpBatch.FromString(payload)
            except DecodeError as e:
                raise InvalidArgument(
                    f"Leases/Stream (framed): a LeaseOpBatch frame does not decode: {e}"
                ) from None
            yield batch


def _peer(writer: asyncio.StreamWriter) -> str:
    """The caller's address, as gRPC writes a peer ("ipv4:host:port", "ipv6:[host]:port")."""
    address = writer.get_extra_info("peername")
    if not isinstance(address, tuple):
        return str(address)
    host, port = address[0], address[1]
    return f"{'ipv6' if ':' in host else 'ipv4'}:{join_host_port(host, port)}"

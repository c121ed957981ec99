"""The emulated NIXL side channel: block reads and notifications over TCP.

Every engine listens at its ``remote_host:remote_port``. A message is a 4-byte
big-endian length followed by a msgspec-msgpack struct. A puller handshakes once
per remote engine id (``Handshake``: the holder's agent, a name drawn per process
start like vLLM's NIXL agent's uuid4), then sends ``ReadBlocks`` (answered with
the raw KV of those blocks, copied) and ``Notify`` (the holder frees the request's
blocks), both naming that agent. Errors come back as ``Reply(ok=False, error=...)``
and surface as ``TransferError``.

The puller keeps its handshakes (`RemoteAgents`) as vLLM's NIXL worker does
(``_remote_agents``, never re-validated; base_worker.py ``_ensure_handshake``,
``add_remote_agent``): an engine restarted under the same fixed engine id is, to a
puller holding a handshake of the old process, an agent that is gone (the read
fails, and the handshake is dropped, so the next one handshakes again); to one
holding none, the new process, whose memory it reads at the old block ids.

A read's answer carries the blocks' KV as one buffer, the blocks' contents in
the order asked for, so that neither side builds or walks one object per block.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Protocol

import msgspec
import structlog

from kvferry.decoding import UNDECODABLE

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024


class Handshake(msgspec.Struct, tag="handshake"):
    """Ask for the holder's agent, expecting engine `engine_id` (vLLM checks the id too)."""

    engine_id: str


class ReadBlocks(msgspec.Struct, tag="read"):
    """Ask for the KV of blocks held for a request."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    registration_generation: int | None = None
    agent: str = ""
    """The holder's agent as the puller's handshake named it ("": not checked)."""


class Notify(msgspec.Struct, tag="notify"):
    """Tell the holder the puller is done with a request's blocks."""

    engine_id: str
    request_id: str
    agent: str = ""
    """The holder's agent as the puller's handshake named it ("": not checked)."""


class Reply(msgspec.Struct, tag="reply"):
    """Answer to a message; ``data`` holds the KV of the blocks read, concatenated, and
    ``agent`` the holder's agent (to a handshake)."""

    ok: bool
    error: str = ""
    data: bytes = b""
    agent: str = ""


Message = Handshake | ReadBlocks | Notify | Reply

_encoder = msgspec.msgpack.Encoder()
_GARBLED: tuple[type[Exception], ...] = (*UNDECODABLE, ValueError)
"""A message that does not decode (or nests deeper than msgspec recurses), or bad values."""
_decoder = msgspec.msgpack.Decoder(Message)


class SideChannelError(Exception):
    """A holder refuses a request (unknown engine or request, bad block ids)."""


class TransferError(Exception):
    """A read or notify failed: refused, unreachable, timed out or garbled."""


class BlockHolder(Protocol):
    """What the server asks of the engine."""

    def handshake(self, request: Handshake) -> str:
        """The holder's agent; raises SideChannelError when it is not engine `engine_id`."""
        ...

    def read_blocks(self, request: ReadBlocks) -> bytes:
        """KV of the requested blocks, concatenated in order; raises SideChannelError to refuse."""
        ...

    def release_blocks(self, request: Notify) -> None:
        """Free a request's held blocks; raises SideChannelError when unknown."""
        ...


async def _read_message(reader: asyncio.StreamReader) -> Message:
    header = await reader.readexactly(_HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes is too large")
    return _decoder.decode(await reader.readexactly(size))


async def _write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    payload = _encoder.encode(message)
    writer.write(_HEADER.pack(len(payload)) + payload)
    await writer.drain()


def _resolve_bind_host(host: str) -> str:
    """One address for a host name, so that port 0 gives a single port."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


class SideChannelServer:
    """TCP server answering reads and notifies for one engine."""

    def __init__(self, holder: BlockHolder, host: str, port: int) -> None:
        self._holder = holder
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen; the bound port is ``self.port`` afterwards."""
        self._server = await asyncio.start_server(self._serve, _resolve_bind_host(self._host), self._port)

    @property
    def port(self) -> int:
        """The bound port."""
        if self._server is None:
            raise RuntimeError("side channel not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    message = await _read_message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except _GARBLED as exc:
                    await _write_message(writer, Reply(ok=False, error=str(exc)))
                    return
                await _write_message(writer, self._answer(message))
        except ConnectionError:
            return
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    def _answer(self, message: Message) -> Reply:
        try:
            if isinstance(message, Handshake):
                return Reply(ok=True, agent=self._holder.handshake(message))
            if isinstance(message, ReadBlocks):
                return Reply(ok=True, data=self._holder.read_blocks(message))
            if isinstance(message, Notify):
                self._holder.release_blocks(message)
                return Reply(ok=True)
        except SideChannelError as exc:
            return Reply(ok=False, error=str(exc))
        return Reply(ok=False, error="unexpected message")

    async def close(self) -> None:
        """Stop listening and drop open connections."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None


async def _call(host: str, port: int, message: Message) -> Reply:
    """One request/reply exchange; callers bound it with ``asyncio.timeout``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await _write_message(writer, message)
            reply = await _read_message(reader)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    except (OSError, OverflowError, asyncio.IncompleteReadError) as exc:
        raise TransferError(f"side channel {host}:{port} unreachable: {exc}") from exc
    except _GARBLED as exc:
        raise TransferError(f"side channel {host}:{port} garbled: {exc}") from exc
    if not isinstance(reply, Reply):
        raise TransferError(f"side channel {host}:{port} sent no reply")
    if not reply.ok:
        raise TransferError(reply.error or "refused")
    return reply


async def read_remote_blocks(host: str, port: int, request: ReadBlocks) -> bytes:
    """KV of remote blocks, concatenated in the order of the requested block ids (the
    caller checks the size against its own blocks')."""
    reply = await _call(host, port, request)
    return reply.data


async def notify_remote(host: str, port: int, request: Notify) -> None:
    """Tell a holder to free a request's blocks."""
    await _call(host, port, request)


class RemoteAgents:
    """A puller's handshakes, by remote engine id (see the module doc)."""

    def __init__(self) -> None:
        self._agents: dict[str, str] = {}

    async def agent(self, host: str, port: int, engine_id: str) -> str:
        """The agent of remote engine `engine_id`: the cached handshake's, else a new one's."""
        agent = self._agents.get(engine_id)
        if agent is None:
            reply = await _call(host, port, Handshake(engine_id))
            agent = self._agents[engine_id] = reply.agent
        return agent

    def failed(self, engine_id: str, agent: str) -> None:
        """A transfer naming `agent` failed: its handshake is dropped (made again next time)."""
        if self._agents.get(engine_id) == agent:
            del self._agents[engine_id]

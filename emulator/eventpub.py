"""ZMQ publisher of KV-event batches with vLLM's replay protocol.

PUB: multipart ``[topic, seq, payload]``, ``seq`` from 0 per publisher start.
ROUTER (replay): a request is one 8-byte big-endian start seq (from a REQ
socket, or a DEALER sending an empty delimiter first); the answer is one
``[topic, seq, payload]`` message per buffered batch with seq >= start, then
``[b"", -1, b""]``, as vLLM 0.32 sends them (``vllm/distributed/kv_events.py``,
``ZmqEventPublisher._service_replay``: the topic frame is there even when the topic
is empty; releases before it sent ``[seq, payload]`` and ``[-1, b""]``). Only the
last ``buffer_steps`` batches are kept.

Events emitted within one event-loop turn are published as one batch, the way
vLLM publishes the events of one scheduler step together.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import structlog
import zmq
import zmq.asyncio

from emulator.kvevents import (
    END_SEQ,
    Event,
    KVEventBatch,
    encode_batch,
    encode_seq,
)

log = structlog.get_logger(__name__)


def _bound_endpoint(socket: zmq.asyncio.Socket, host: str, port: int) -> str:
    """Bind a socket (port 0 = any free port) and return a connectable endpoint.

    A port in use or a bad host raises OSError, as any other listener's would (ZMQError
    is not one: the process would end in a traceback instead of one line)."""
    wanted = f"tcp://{host}:{'*' if port == 0 else port}"
    try:
        socket.bind(wanted)
    except zmq.ZMQError as e:
        raise OSError(e.errno, f"cannot bind the KV-event socket to {wanted}: {e}") from e
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    if host in ("*", "0.0.0.0"):
        bound_port = endpoint.rsplit(":", 1)[1]
        endpoint = f"tcp://127.0.0.1:{bound_port}"
    return endpoint


class KVEventPublisher:
    """Publishes KV-event batches on a PUB socket and answers replay requests."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        replay_port: int | None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._host = host
        self._port = port
        self._replay_port = replay_port
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._dp_rank = data_parallel_rank
        self._pending: list[Event] = []
        self._flush_scheduled = False
        self._next_seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._queue: asyncio.Queue[KVEventBatch | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoint: str | None = None
        """Connectable PUB endpoint, known after start()."""
        self.replay_endpoint: str | None = None
        """Connectable ROUTER endpoint, known after start() when replay is on."""

    async def start(self) -> None:
        """Bind the sockets and start the sender and replay tasks."""
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bound_endpoint(self._pub, self._host, self._port)
        self._tasks.append(asyncio.create_task(self._send_loop(), name="kvevents-pub"))
        if self._replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bound_endpoint(self._replay, self._host, self._replay_port)
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kvevents-replay"))
        log.info(
            "kvevents.publisher.started",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
        )

    def emit(self, event: Event) -> None:
        """Queue an event; events of one loop turn are published as one batch."""
        if self._pub is None:
            return
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        batch = KVEventBatch(ts=time.time(), events=self._pending, data_parallel_rank=self._dp_rank)
        self._pending = []
        self._queue.put_nowait(batch)

    async def _send_loop(self) -> None:
        assert self._pub is not None
        while True:
            batch = await self._queue.get()
            if batch is None:
                return
            payload = encode_batch(batch)
            seq = self._next_seq
            self._next_seq += 1
            await self._pub.send_multipart([self._topic, encode_seq(seq), payload])
            self._buffer.append((seq, payload))

    async def _replay_loop(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("kvevents.replay.invalid_request", frames=len(frames))
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart([client, b"", self._topic, encode_seq(seq), payload])
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        """Publish what is pending, stop the tasks and close the sockets."""
        if self._pub is None:
            return
        self._flush()
        self._queue.put_nowait(None)
        if self._tasks:  # (none when the start failed at a bind)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout=1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        assert self._ctx is not None
        self._ctx.term()
        self._pub = None
        self._replay = None
        log.info("kvevents.publisher.stopped", published=self._next_seq)

    @property
    def published(self) -> int:
        """Number of batches published since start."""
        return self._next_seq

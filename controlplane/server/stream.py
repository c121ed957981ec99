"""Leases/Stream: Register and Lookup ops multiplexed on one long-lived stream.

Each op runs as it arrives (up to STREAM_WINDOW at once: then the stream stops reading,
and gRPC flow control holds the client back; a lookup that needs no await is answered
by the reader itself, with no task); results go out in completion order, those
that are ready together in one message (`kvferry.framing.encoded_runs`: each result is
encoded once, when it is made; the handler's serializer passes bytes through). A lookup sent with
prompt_follows waits for its LookupPrompt op (same id) outside the window: the reader
must never wait for a slot only a later prompt on the same stream could free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import grpc

from controlplane import metrics
from controlplane.errors import InvalidArgument, KvferryError, ResourceExhausted
from controlplane.server.status import abort, fill_op_error
from kvferry.framing import encoded_runs
from kvferry.tasks import spawn
from kvferry.v1 import leases_pb2

#: Operations one Leases/Stream may have in flight at once (backpressure beyond it).
STREAM_WINDOW = 1024
_LATENCY = {
    False: metrics.RPC_LATENCY.labels("Leases/Stream.register"),
    True: metrics.RPC_LATENCY.labels("Leases/Stream.lookup"),
}

_RESULTS_FIELD = leases_pb2.LeaseOpResultBatch.RESULTS_FIELD_NUMBER
Later = asyncio.Future[leases_pb2.LookupPrompt]
Register = Callable[[leases_pb2.RegisterLeaseRequest], Awaitable[leases_pb2.RegisterLeaseResponse]]
Lookup = Callable[[leases_pb2.LookupRequest, leases_pb2.LookupResponse, Later | None], Awaitable[Any]]
LookupNow = Callable[[leases_pb2.LookupRequest, leases_pb2.LookupResponse], bool]
"""Fills the response and says True when it answered without awaiting; False: did nothing."""


class OpStream:
    """One Leases/Stream call: its ops as they run, and its results until they are sent."""

    def __init__(self, register: Register, lookup: Lookup, lookup_now: LookupNow | None = None) -> None:
        """`register` and `lookup` answer one op each (as the unary calls do: `lookup`
        fills the response it is given, its prompt coming from the future it gets);
        `lookup_now` answers a lookup at once when it can (see `_answered_now`)."""
        self._register = register
        self._lookup = lookup
        self._lookup_now = lookup_now
        self._ready: list[bytes] = []  # results, encoded
        self._wake = asyncio.Event()
        self._taken = asyncio.Event()  # results were taken out to be sent
        self._window = asyncio.Semaphore(STREAM_WINDOW)
        self._running: set[asyncio.Task[None]] = set()
        # Lookups sent with prompt_follows, by op id, until their LookupPrompt op arrives.
        self._awaiting: dict[int, Later] = {}
        self._prompt_at: dict[int, float] = {}
        self._reading = True
        self._broken: list[InvalidArgument] = []  # a request message that did not decode

    async def serve(
        self,
        requests: AsyncIterator[leases_pb2.LeaseOpBatch],
        context: grpc.aio.ServicerContext[Any, Any] | None = None,
    ) -> AsyncIterator[bytes]:
        """The result batches (LeaseOpResultBatch, encoded), until the request stream ends
        and every op is answered. A request that did not decode then aborts `context`'s
        call (without one: raises the InvalidArgument)."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                # Look before waiting: the last results and the end of the request
                # stream can arrive together, with no wake-up left to come.
                if self._ready:
                    out, self._ready = self._ready, []
                    self._taken.set()
                    for batch in encoded_runs(out, _RESULTS_FIELD):
                        yield batch
                    continue
                if not self._reading:
                    break
                await self._wake.wait()
                self._wake.clear()
            await reader  # surfaces a broken request stream
            if self._broken:
                if context is None:
                    raise self._broken[0]
                await abort(context, self._broken[0], "Leases/Stream")
        finally:
            reader.cancel()
            for t in list(self._running):
                t.cancel()
            # Until each has taken its cancellation in (a claim then arranges its put-back,
            # which a daemon's stop waits for: see ControlPlane.settle).
            await asyncio.gather(reader, *self._running, return_exceptions=True)

    def _start(self, op: Coroutine[Any, Any, None]) -> None:
        spawn(op, self._running)

    async def _run(self, op: leases_pb2.LeaseOp, later: Later | None) -> None:
        res = leases_pb2.LeaseOpResult(id=op.id)
        kind = op.WhichOneof("op")
        start = time.perf_counter()
        try:
            if kind == "register":
                res.register.CopyFrom(await self._register(op.register))
            elif kind == "lookup":
                await self._lookup(op.lookup, res.lookup, later)
            else:
                raise InvalidArgument("LeaseOp has no op")
        except Exception as e:
            fill_op_error(res.error, e, f"Leases/Stream.{kind}")
        finally:
            if later is None:
                self._window.release()
            else:  # timed from its prompt: the wait before it is the caller's work
                self._awaiting.pop(op.id, None)
                start = self._prompt_at.pop(op.id, start)
            _LATENCY[kind == "lookup"].observe(time.perf_counter() - start)
        self._answer(res)

    def _answered_now(self, op: leases_pb2.LeaseOp) -> bool:
        """Answer a lookup op in the reader, with no task, when nothing about it needs
        awaiting (`lookup_now`: the usual turn, its claim decided in its owner's memory).
        Nothing awaits, so nothing can cut it short. -> whether it was answered."""
        if self._lookup_now is None:
            return False
        res = leases_pb2.LeaseOpResult(id=op.id)
        start = time.perf_counter()
        try:
            if not self._lookup_now(op.lookup, res.lookup):
                return False
        except Exception as e:
            fill_op_error(res.error, e, "Leases/Stream.lookup")
        _LATENCY[True].observe(time.perf_counter() - start)
        self._answer(res)
        return True

    def _answer(self, res: leases_pb2.LeaseOpResult) -> None:
        self._ready.append(res.SerializeToString())
        self._wake.set()

    def _refuse(self, op_id: int, error: KvferryError) -> None:
        res = leases_pb2.LeaseOpResult(id=op_id)
        fill_op_error(res.error, error, "Leases/Stream")
        self._answer(res)

    def _prompt_arrived(self, op: leases_pb2.LeaseOp) -> None:
        waiting = self._awaiting.get(op.id)
        if waiting is None or waiting.done():
            self._refuse(
                op.id, InvalidArgument(f"no lookup on this stream is waiting for a prompt with id {op.id}")
            )
            return
        self._prompt_at[op.id] = time.perf_counter()
        waiting.set_result(op.prompt)

    async def _read(self, requests: AsyncIterator[leases_pb2.LeaseOpBatch]) -> None:
        try:
            try:
                await self._read_ops(requests)
            except InvalidArgument as e:  # stop reading; what runs still answers
                self._broken.append(e)
                for waiting in self._awaiting.values():  # no prompt will come: answer no_prompt
                    if not waiting.done():
                        waiting.set_result(leases_pb2.LookupPrompt())
            # (The request stream also ends this way when the client cancels the call:
            # lookups still waiting for a prompt then wait on, to be cancelled with the
            # call and have their claims put back, rather than answer and spend them.)
            while self._running:
                await asyncio.wait(set(self._running))
        finally:
            self._reading = False
            self._wake.set()

    async def _read_ops(self, requests: AsyncIterator[leases_pb2.LeaseOpBatch]) -> None:
        async for batch in requests:
            while len(self._ready) >= STREAM_WINDOW:
                # The client is not reading its results: stop reading its ops too
                # (gRPC flow control then holds the client back), or the results grow.
                self._taken.clear()
                await self._taken.wait()
            for op in batch.ops:
                kind = op.WhichOneof("op")
                if kind == "prompt":
                    self._prompt_arrived(op)
                elif kind == "lookup" and op.lookup.prompt_follows:
                    self._await_prompt(op)
                elif not (kind == "lookup" and self._answered_now(op)):
                    await self._window.acquire()
                    self._start(self._run(op, None))

    def _await_prompt(self, op: leases_pb2.LeaseOp) -> None:
        """Start a prompt_follows lookup (not counted in the window), registered before the
        next op is read: its prompt may be in the same batch."""
        if op.id in self._awaiting:
            self._refuse(op.id, InvalidArgument(f"lookup {op.id} is already waiting for its prompt"))
        elif len(self._awaiting) >= STREAM_WINDOW:
            self._refuse(op.id, ResourceExhausted(f"{STREAM_WINDOW} lookups already wait for prompts"))
        else:
            later = self._awaiting[op.id] = asyncio.get_running_loop().create_future()
            self._start(self._run(op, later))

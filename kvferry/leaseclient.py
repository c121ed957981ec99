"""Client side of Leases/Stream: many concurrent Register and Lookup calls over one
long-lived gRPC stream. Shared by the sidecar, the router and the benchmarks.

A gRPC message costs far more than an operation in gRPC Python, so calls made
while a write is in progress leave together in the next message (one op per
message when idle, many under load, up to `kvferry.framing`'s size budget). A
broken stream fails the calls in flight with UNAVAILABLE; the next call opens a
new one. Each call has its own timeout.

The names follow the gRPC API's (the ``Leases`` service, its ``LeaseOp`` messages):
what they carry are retention registrations and lookups, no etcd lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvferry.framedstream import status_code
from kvferry.framing import by_size
from kvferry.limits import ANSWER_VALID_S
from kvferry.tasks import cancel_and_wait
from kvferry.v1 import leases_pb2, leases_pb2_grpc


class LeaseOpError(Exception):
    """An operation failed; `code` is the gRPC status the unary call would have returned.

    `stream_lost`: the stream itself broke or ended (the replica or the way to it is in
    doubt), rather than the daemon answering this one op with an error or the op timing out;
    `code` is then the status the stream ended with (a stream refused with, say,
    PERMISSION_DENIED or RESOURCE_EXHAUSTED ran none of its ops unanswered).
    `sent`: the op was handed to the stream, so the daemon may have carried it out; false
    only when it surely never left this process.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, stream_lost: bool = False, sent: bool = True
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.stream_lost = stream_lost
        self.sent = sent


LATE_ANSWER_S = 10.0
"""How long an answer given up on is still waited for when its caller wants it late."""
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from the stubs
CLOSE_WRITING_S = 1.0
"""Longest a close waits for the stream to take its end of writing."""


Answer = asyncio.Future[leases_pb2.LeaseOpResult]


def _await_late(
    fut: Answer,
    late: Callable[[leases_pb2.LeaseOpResult], None],
    wait_s: float,
    owed: set[Answer],
    forget: Callable[[], None],
) -> None:
    """Wait up to `wait_s` more for `fut`, the answer to an op whose caller gave up (in
    `owed` meanwhile); `late` gets it unless it is an error, and `forget` drops the op."""

    def give_up() -> None:
        forget()
        fut.cancel()

    def answered(f: Answer) -> None:
        timer.cancel()
        owed.discard(f)
        forget()
        if f.cancelled() or f.exception() is not None:
            return
        res = f.result()
        if res.WhichOneof("result") != "error":
            late(res)

    timer = asyncio.get_running_loop().call_later(wait_s, give_up)
    owed.add(fut)
    fut.add_done_callback(answered)


Opener = Callable[[], Any]
"""Opens one Leases/Stream call (written to, read from: not iterated)."""


def _grpc_stream(channel: grpc.aio.Channel | None) -> Opener:
    assert channel is not None, "a LeaseStream needs a channel or an opener"
    stub = leases_pb2_grpc.LeasesStub(channel)
    return lambda: stub.Stream()  # type: ignore[call-arg]


class LeaseStream:
    """One Leases/Stream to one daemon replica, opened on the first call and again after
    it broke; its calls are coroutines any number of tasks may await at once."""

    def __init__(
        self,
        channel: grpc.aio.Channel | None,
        late_answer_s: float = LATE_ANSWER_S,
        opener: Opener | None = None,
    ) -> None:
        """Streams open on `channel` (gRPC), or with `opener` (a call with the same methods:
        a framed one to the daemon's --stream-listen, `kvferry.framedstream.opener`)."""
        self._late_answer_s = late_answer_s
        self._opener = opener or _grpc_stream(channel)
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[leases_pb2.LeaseOpResult]] = {}
        self._ids = itertools.count(1)
        self._outbox: list[leases_pb2.LeaseOp] = []
        self._written: set[int] = set()  # ids of the ops in flight handed to the stream
        self._owed: set[asyncio.Future[leases_pb2.LeaseOpResult]] = set()
        """Answers still awaited for callers that gave up (see `_answer_late`)."""
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._open_lock = asyncio.Lock()

    async def register(
        self, req: leases_pb2.RegisterLeaseRequest, deadline_s: float
    ) -> leases_pb2.RegisterLeaseResponse:
        """Register a retention (LeaseOpError when it fails or `deadline_s` passes)."""
        res = await self._op(leases_pb2.LeaseOp(register=req), deadline_s)
        return res.register

    async def lookup(self, req: leases_pb2.LookupRequest, deadline_s: float) -> leases_pb2.LookupResponse:
        """Look a retention up, its prompt known (LeaseOpError when it fails or `deadline_s` passes)."""
        res = await self._op(leases_pb2.LeaseOp(lookup=req), deadline_s, valid_s=ANSWER_VALID_S)
        return res.lookup

    async def lookup_with_prompt(
        self,
        req: leases_pb2.LookupRequest,
        prompt: Awaitable[leases_pb2.LookupPrompt | None],
        deadline_s: float | Callable[[], float],
        late: Callable[[leases_pb2.LookupResponse], None] | None = None,
    ) -> leases_pb2.LookupResponse:
        """A Lookup sent before its prompt is known: the daemon claims the retention while
        `prompt` is awaited, then decides on it. `deadline_s` counts from when the prompt
        is ready (the work before it has deadlines of its own); a callable is asked for it
        then (a deadline that depends on the prompt). An answer that comes after the
        deadline, or after the caller was cancelled (up to `late_answer_s`), goes to
        `late`: what the daemon claimed for it. (A lookup that had not left by then never
        does: nothing is claimed for it.)

        When `prompt` gives None, fails or is cancelled, an empty prompt still goes (the
        daemon answers RECOMPUTE / no_prompt with release_params for what it claimed, so
        nothing waits on the daemon's side); `prompt`'s own failure is its owner's to see.
        """
        req.prompt_follows = True

        async def then_prompt(op_id: int) -> None:
            later: leases_pb2.LookupPrompt | None = None
            try:
                later = await prompt
            except Exception:
                pass  # the awaitable's owner sees it fail; the daemon gets an empty prompt
            finally:  # also when cancelled: end the daemon's wait at once
                self._enqueue(leases_pb2.LeaseOp(id=op_id, prompt=later or leases_pb2.LookupPrompt()))

        late_result = (lambda res: late(res.lookup)) if late is not None else None
        res = await self._op(
            leases_pb2.LeaseOp(lookup=req), deadline_s, then_prompt, late_result, ANSWER_VALID_S
        )
        return res.lookup

    async def lookup_verifying(
        self,
        req: leases_pb2.LookupRequest,
        ready: Awaitable[object],
        deadline_s: float | Callable[[], float],
        late: Callable[[leases_pb2.LookupResponse], None] | None = None,
    ) -> leases_pb2.LookupResponse:
        """A Lookup sent with caller_verifies before the prompt is known (the caller then
        verifies it against the answer's `check`): waits for `ready` (the prompt; what it
        gives or raises is its owner's to see), then as `lookup_with_prompt` does."""
        req.caller_verifies = True

        async def prompt_ready(op_id: int) -> None:
            with contextlib.suppress(Exception):
                await ready

        late_result = (lambda res: late(res.lookup)) if late is not None else None
        res = await self._op(
            leases_pb2.LeaseOp(lookup=req), deadline_s, prompt_ready, late_result, ANSWER_VALID_S
        )
        return res.lookup

    async def _op(
        self,
        op: leases_pb2.LeaseOp,
        deadline_s: float | Callable[[], float],
        before_deadline: Callable[[int], Awaitable[None]] | None = None,
        late: Callable[[leases_pb2.LeaseOpResult], None] | None = None,
        valid_s: float | None = None,
    ) -> leases_pb2.LeaseOpResult:
        """Send `op`, run `before_deadline(op.id)` if given, then wait up to `deadline_s`
        (asked then, when a callable), and no longer than `valid_s` from when the op was
        handed to the stream; with `late`, hand it an answer that comes after that."""
        op.id = next(self._ids)
        fut: asyncio.Future[leases_pb2.LeaseOpResult] = asyncio.get_running_loop().create_future()
        self._pending[op.id] = fut
        answer_late, why = False, ""
        try:
            await self._open()  # creates the call when there is none; never waits on the network
            self._enqueue(op)
            enqueued = time.monotonic()
            if before_deadline is not None:
                await before_deadline(op.id)
            if callable(deadline_s):
                deadline_s = deadline_s()
            if valid_s is not None:
                left = valid_s - (time.monotonic() - enqueued)
                if left < deadline_s:
                    deadline_s = max(0.0, left)
                    why = f" (an answer is valid {valid_s:g}s from when its op left)"
                if left <= 0:  # (an answer already in would be taken: a timeout fires only in a wait)
                    raise TimeoutError
            async with asyncio.timeout(deadline_s):
                res = await (fut if late is None else asyncio.shield(fut))
        except asyncio.CancelledError:  # the caller went away
            answer_late = self._given_up(op.id, fut, late)
            raise
        except TimeoutError:
            answer_late = self._given_up(op.id, fut, late)
            raise LeaseOpError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer within {deadline_s:.3g}s{why}",
                sent=op.id in self._written,
            ) from None
        except LeaseOpError as e:  # the stream ended with this op in flight (`_read`)
            raise LeaseOpError(e.code, e.message, e.stream_lost, sent=op.id in self._written) from None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            await self._reset()
            raise LeaseOpError(
                grpc.StatusCode.UNAVAILABLE, f"lease stream broke: {e}", True, sent=op.id in self._written
            ) from e
        finally:
            if not answer_late:  # (else `_answer_late` does)
                self._forget(op.id)
        if res.WhichOneof("result") == "error":
            raise LeaseOpError(status_code(res.error.code), res.error.message)
        return res

    def _given_up(
        self,
        op_id: int,
        fut: asyncio.Future[leases_pb2.LeaseOpResult],
        late: Callable[[leases_pb2.LeaseOpResult], None] | None,
    ) -> bool:
        """Its caller gave up on an op: one that has not left is taken back, and never leaves;
        for one that left, with `late`, the answer still matters (`_answer_late`). -> whether
        the answer is awaited.

        A lookup sent late (the stream still connecting) would claim what its conversation
        holds by then: maybe the retention of the very turn that went on without it, whose
        release would cost the next turn its reuse."""
        if late is None or op_id not in self._written:
            self._withdraw(op_id)
            return False
        self._answer_late(op_id, fut, late)
        return True

    def _answer_late(
        self,
        op_id: int,
        fut: asyncio.Future[leases_pb2.LeaseOpResult],
        late: Callable[[leases_pb2.LeaseOpResult], None],
    ) -> None:
        """Keep waiting, up to `late_answer_s`, for the answer to an op whose caller gave up;
        `late` gets it unless it is an error (or the stream broke meanwhile)."""

        def forget() -> None:
            if self._pending.get(op_id) is fut:
                self._forget(op_id)

        _await_late(fut, late, self._late_answer_s, self._owed, forget)

    async def owed_answers(self, timeout_s: float) -> None:
        """Until the answers still awaited for callers that gave up have come (their `late`
        hooks ran), or `timeout_s`: a stop waits for them before it closes the stream, as
        such an answer may hand back what the daemon claimed for a turn that went away."""
        if self._owed and timeout_s > 0:
            await asyncio.wait(set(self._owed), timeout=timeout_s)

    def _enqueue(self, op: leases_pb2.LeaseOp) -> None:
        """Hand `op` to the writer (it leaves in the next message)."""
        self._outbox.append(op)
        self._wake.set()

    def _withdraw(self, op_id: int) -> None:
        """Take an op its caller gave up on out of the outbox, if it has not left yet (then
        it never will: its `LeaseOpError.sent` is false, and true to that). A lookup that
        left keeps its prompt op: the daemon waits for it."""
        if op_id not in self._written:
            self._outbox = [op for op in self._outbox if op.id != op_id]

    def _forget(self, op_id: int) -> None:
        self._pending.pop(op_id, None)
        self._written.discard(op_id)

    def _fail_pending(self, error: LeaseOpError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)

    async def _write(self, call: Any) -> None:
        """The stream's only writer: sends whatever is in the outbox, one message at a time.

        Callers never write themselves, so a caller that times out cannot cancel a
        write half-way (which would end the whole stream)."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._outbox:
                    # One message's worth leaves the outbox at a time: the rest can still
                    # be taken back (`_withdraw`) while this write waits.
                    ops = next(by_size(self._outbox))
                    del self._outbox[: len(ops)]
                    # Leaving: from now on the daemon may act on them (a write that blocks,
                    # on a daemon that stopped reading, say, may still go out).
                    self._written.update(op.id for op in ops if op.id in self._pending)
                    try:
                        await call.write(leases_pb2.LeaseOpBatch(ops=ops))
                    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                        # A write that fails sent nothing: the stream could not connect, or is gone.
                        self._written.difference_update(op.id for op in ops)
                        raise
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            call.cancel()  # the reader sees the stream end and fails what is in flight

    async def _open(self) -> Any:
        if self._call is not None:
            return self._call
        async with self._open_lock:
            if self._call is None:
                self._call = self._opener()  # (written to, not iterated)
                self._writer = asyncio.create_task(self._write(self._call))
                self._reader = asyncio.create_task(self._read(self._call, self._writer))
            return self._call

    async def _read(self, call: Any, writer: asyncio.Task[None]) -> None:
        error = LeaseOpError(grpc.StatusCode.UNAVAILABLE, "lease stream ended", True)
        try:
            while True:
                batch = await call.read()
                if batch is _EOF:
                    break
                for res in batch.results:
                    fut = self._pending.get(res.id)
                    if fut is not None and not fut.done():
                        fut.set_result(res)
        except grpc.aio.AioRpcError as e:  # its status kept: it may prove the ops unwritten
            error = LeaseOpError(e.code(), f"lease stream broke: {e.code().name}: {e.details()}", True)
        except asyncio.CancelledError:
            error = LeaseOpError(grpc.StatusCode.CANCELLED, "lease stream closed")
            raise
        finally:
            writer.cancel()
            if self._call is call:  # (else `_reset` or `close` replaced it, and failed its ops)
                self._call = None
                self._outbox = []
                self._fail_pending(error)

    async def _reset(self) -> None:
        call, self._call = self._call, None
        self._outbox = []
        if call is not None:
            call.cancel()
        self._fail_pending(LeaseOpError(grpc.StatusCode.UNAVAILABLE, "lease stream reset", True))

    async def close(self) -> None:
        """End the stream (its end of writing first, briefly); the calls in flight fail with
        CANCELLED."""
        call, reader, writer = self._call, self._reader, self._writer  # (an `_open` meanwhile makes new ones)
        self._call = None
        if call is not None:
            # (bounded: a stream still connecting to a replica that does not answer, or
            # whose writes wait on flow control, must not hold up a stop)
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError):
                await asyncio.wait_for(call.done_writing(), CLOSE_WRITING_S)
            call.cancel()
        await cancel_and_wait([writer, reader])
        self._fail_pending(LeaseOpError(grpc.StatusCode.CANCELLED, "lease stream closed"))

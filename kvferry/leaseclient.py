"""Client side of Leases/Stream: many concurrent Register and Lookup calls over one
long-lived gRPC stream (a stream message costs a fraction of a unary call in
gRPC Python). Shared by the sidecar, the router and the benchmarks.

A broken stream fails the calls in flight with UNAVAILABLE; the next call opens
a new one. Each call has its own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import grpc

from kvferry.v1 import leases_pb2, leases_pb2_grpc


class LeaseOpError(Exception):
    """An operation failed; `code` is the gRPC status the unary call would have returned."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from the stubs


class LeaseStream:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = leases_pb2_grpc.LeasesStub(channel)
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[leases_pb2.LeaseOpResult]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._open_lock = asyncio.Lock()

    async def register(
        self, req: leases_pb2.RegisterLeaseRequest, deadline_s: float
    ) -> leases_pb2.RegisterLeaseResponse:
        res = await self._op(leases_pb2.LeaseOp(register=req), deadline_s)
        return res.register

    async def lookup(self, req: leases_pb2.LookupRequest, deadline_s: float) -> leases_pb2.LookupResponse:
        res = await self._op(leases_pb2.LeaseOp(lookup=req), deadline_s)
        return res.lookup

    async def _op(self, op: leases_pb2.LeaseOp, deadline_s: float) -> leases_pb2.LeaseOpResult:
        op.id = next(self._ids)
        fut: asyncio.Future[leases_pb2.LeaseOpResult] = asyncio.get_running_loop().create_future()
        self._pending[op.id] = fut
        try:
            async with asyncio.timeout(deadline_s):
                call = await self._open()
                async with self._write_lock:
                    await call.write(op)
                res = await fut
        except TimeoutError:
            raise LeaseOpError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {deadline_s}s") from None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            await self._reset()
            raise LeaseOpError(grpc.StatusCode.UNAVAILABLE, f"lease stream broke: {e}") from e
        finally:
            self._pending.pop(op.id, None)
        if res.WhichOneof("result") == "error":
            raise LeaseOpError(_CODES.get(res.error.code, grpc.StatusCode.UNKNOWN), res.error.message)
        return res

    async def _open(self) -> Any:
        if self._call is not None:
            return self._call
        async with self._open_lock:
            if self._call is None:
                self._call = self._stub.Stream()  # type: ignore[call-arg]  # written to, not iterated
                self._reader = asyncio.create_task(self._read(self._call))
            return self._call

    async def _read(self, call: Any) -> None:
        error: BaseException = LeaseOpError(grpc.StatusCode.UNAVAILABLE, "lease stream ended")
        try:
            while True:
                res = await call.read()
                if res is _EOF:
                    break
                fut = self._pending.get(res.id)
                if fut is not None and not fut.done():
                    fut.set_result(res)
        except grpc.aio.AioRpcError as e:
            error = LeaseOpError(
                grpc.StatusCode.UNAVAILABLE, f"lease stream broke: {e.code().name}: {e.details()}"
            )
        except asyncio.CancelledError:
            error = LeaseOpError(grpc.StatusCode.CANCELLED, "lease stream closed")
            raise
        finally:
            if self._call is call:
                self._call = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(error)

    async def _reset(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def close(self) -> None:
        call, reader = self._call, self._reader
        self._call = None
        if call is not None:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await call.done_writing()
            call.cancel()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

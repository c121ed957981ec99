"""The floor under bench.daemon's lookup latency: a Leases/Stream server that does no work.

It answers every lookup op at once with the same PULL (no claim, no etcd, no policy),
over the same gRPC stack, event loop and message shapes as the daemon, in a process of
its own. bench.daemon offers it the rates it offers the daemon, from the same client: what
the echo's p99 is at a rate, no daemon on this machine can beat (gRPC Python's per-message
cost, the event loop's wake-ups, and the scheduler sharing the cores with the load
generator and etcd).

    python -m bench.echo --port N [--framed]    (serves until SIGTERM)

``--framed``: the same on the framed stream (the daemon's --stream-listen) instead of gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvferry.framedstream import DEFAULT_MAX_FRAME, WELCOME, FrameError, frame, read_frame
from kvferry.tasks import run_main
from kvferry.v1 import leases_pb2

_PULL = leases_pb2.LookupResponse(decision=leases_pb2.PULL, reason="pull")


async def _stream(
    requests: AsyncIterator[leases_pb2.LeaseOpBatch], context: Any
) -> AsyncIterator[leases_pb2.LeaseOpResultBatch]:
    """Leases/Stream: each batch's ops answered at once (a lookup: PULL)."""
    async for batch in requests:
        yield _answers(batch.ops)


def _answers(ops: Sequence[leases_pb2.LeaseOp]) -> leases_pb2.LeaseOpResultBatch:
    """Each op answered at once (a lookup: PULL)."""
    out = leases_pb2.LeaseOpResultBatch()
    for op in ops:
        res = out.results.add(id=op.id)
        if op.WhichOneof("op") == "register":
            res.register.SetInParent()
        else:
            res.lookup.CopyFrom(_PULL)
    return out


async def serve(port: int) -> int:
    server = grpc.aio.server()
    stream = grpc.stream_stream_rpc_method_handler(
        _stream,
        request_deserializer=leases_pb2.LeaseOpBatch.FromString,
        response_serializer=leases_pb2.LeaseOpResultBatch.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvferry.v1.Leases", {"Stream": stream}),)
    )
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if not bound:
        print(f"bench.echo: cannot listen on 127.0.0.1:{port}", file=sys.stderr)
        return 1
    await server.start()
    print(bound, flush=True)  # (the port, for a parent that asked for any: --port 0)
    await _until_stopped()
    await server.stop(1)
    return 0


async def serve_framed(port: int) -> int:
    """The same, on the framed stream the daemon's --stream-listen serves (kvferry.framedstream)."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(FrameError, OSError):
            if await read_frame(reader, DEFAULT_MAX_FRAME) is None:  # (the hello: anyone is let in)
                return
            writer.write(WELCOME)
            while payload := await read_frame(reader, DEFAULT_MAX_FRAME):
                batch = leases_pb2.LeaseOpBatch.FromString(payload)
                writer.write(frame(_answers(batch.ops).SerializeToString()))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", port)
    print(server.sockets[0].getsockname()[1], flush=True)
    await _until_stopped()
    server.close()
    return 0


async def _until_stopped() -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.echo", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True, help="0: any free port, printed on stdout")
    p.add_argument("--framed", action="store_true", help="serve the framed stream, not gRPC")
    args = p.parse_args(argv)
    return run_main(serve_framed(args.port) if args.framed else serve(args.port))


if __name__ == "__main__":
    raise SystemExit(main())

"""Parts of bench.demo's deployment, each in a process of its own: an engine emulator with
its sidecar, or a router. bench.demo runs them all in the benchmark's own process, which
one core caps; a benchmark that must load every core of the machine (bench.busy) starts
them here instead.

A part prints one JSON line on stdout once it serves (``{"url": ...}``), and runs until
SIGTERM or SIGINT:

    python -m bench.parts engine --role decode --daemon 127.0.0.1:50051 [--num-blocks N]
    python -m bench.parts router --daemon 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from bench.demo import engine_config, router_settings, sidecar_settings
from emulator import EmulatorServer
from kvferry import logs
from kvferry.tasks import run_main
from router import Router
from sidecar import Sidecar

STARTED_S = 60.0
"""Longest a part may take to print its URL."""


@dataclass
class Part:
    """A part in its own process, serving at `url`."""

    proc: asyncio.subprocess.Process
    url: str

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start(*args: str) -> Part:
    """Start the part `args` name (this module's command line). -> it, serving."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.parts", *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), STARTED_S)
        return Part(proc, json.loads(line)["url"])
    except (TimeoutError, ValueError, KeyError):
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"bench.parts {' '.join(args)} did not start (exit {proc.returncode})") from None


@contextlib.asynccontextmanager
async def started(*args: str) -> AsyncIterator[Part]:
    part = await start(*args)
    try:
        yield part
    finally:
        await part.stop()


async def _serve(args: argparse.Namespace) -> int:
    async with contextlib.AsyncExitStack() as stack:
        if args.part == "engine":
            changes = {"num_blocks": args.num_blocks} if args.num_blocks else {}
            if args.no_prefix_caching:
                changes["enable_prefix_caching"] = False
            emu = await stack.enter_async_context(EmulatorServer(engine_config(args.role, **changes)))
            await stack.enter_async_context(Sidecar(sidecar_settings(emu, args.daemon, args.role)))
            url = emu.http_url
        else:
            url = (await stack.enter_async_context(Router(router_settings(args.daemon)))).url
        print(json.dumps({"url": url}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parts", description=__doc__.split("\n")[0])
    p.add_argument("part", choices=("engine", "router"))
    p.add_argument("--daemon", required=True, help="the daemon's address")
    p.add_argument("--role", choices=("prefill", "decode"), default="decode", help="an engine's role")
    p.add_argument("--num-blocks", type=int, default=0, help="an engine's KV blocks (0: the default)")
    p.add_argument("--no-prefix-caching", action="store_true", help="an engine's local prefix cache off")
    args = p.parse_args(argv)
    logs.configure("error")
    return run_main(_serve(args))


if __name__ == "__main__":
    raise SystemExit(main())

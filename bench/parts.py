"""Parts of bench.demo's deployment, each in a process of its own: an engine emulator with
its sidecar, a router, or the multi-turn proxy stand-in (`bench.router_paths`).
bench.demo runs them all in the benchmark's own process, which one core caps, and where a
front door's work queues behind the engines' and sidecars' on one event loop. A
benchmark that must load every core of the machine (bench.busy), or compare front doors
as a deployment runs them (bench.router's speedup), starts them here instead.

A part prints one JSON line on stdout once it serves (``{"url": ...}``; a router: once it
knows the daemon's nodes), and runs until SIGTERM or SIGINT:

    python -m bench.parts engine --role decode --daemon 127.0.0.1:50051 [--num-blocks N]
    python -m bench.parts router --daemon 127.0.0.1:50051 [--daemon-stream ADDR] [--tokenizer DIR]
        [--reuse false]
    python -m bench.parts stand-in --prefill http://p:8100 --decode http://d-sidecar:8200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from bench.demo import engine_config, router_settings, sidecar_settings
from bench.router_paths import MultiturnProxyStandIn
from emulator import EmulatorServer
from kvferry import logs
from kvferry.tasks import run_main
from realvllm.process import stop_child
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
        await stop_child(self.proc)


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
            await stack.enter_async_context(
                Sidecar(sidecar_settings(emu, args.daemon, args.role, args.daemon_stream))
            )
            url = emu.http_url
        elif args.part == "router":
            settings = router_settings(args.daemon, reuse=args.reuse == "true", stream=args.daemon_stream)
            settings = replace(settings, upstream=replace(settings.upstream, tokenizer=args.tokenizer))
            url = (await stack.enter_async_context(Router(settings))).url
        else:
            proxy = MultiturnProxyStandIn(args.prefill, args.decode)
            await proxy.start()
            stack.push_async_callback(proxy.stop)
            url = proxy.url
        print(json.dumps({"url": url}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parts", description=__doc__.split("\n")[0])
    p.add_argument("part", choices=("engine", "router", "stand-in"))
    p.add_argument("--daemon", default="", help="the daemon's address (an engine's, a router's)")
    p.add_argument(
        "--daemon-stream", default="", help="the daemon's --stream-listen address (a router's, a sidecar's)"
    )
    p.add_argument("--role", choices=("prefill", "decode"), default="decode", help="an engine's role")
    p.add_argument("--num-blocks", type=int, default=0, help="an engine's KV blocks (0: the default)")
    p.add_argument("--no-prefix-caching", action="store_true", help="an engine's local prefix cache off")
    p.add_argument("--tokenizer", default="", help="a router's tokenizer files (none: P's /tokenize)")
    p.add_argument("--reuse", choices=("true", "false"), default="true", help="a router's KV reuse")
    p.add_argument("--prefill", default="", help="the stand-in's prefill node URL")
    p.add_argument("--decode", default="", help="the stand-in's decode node URL (its sidecar)")
    args = p.parse_args(argv)
    if args.part != "stand-in" and not args.daemon:
        p.error(f"{args.part} needs --daemon")
    if args.part == "stand-in" and not (args.prefill and args.decode):
        p.error("stand-in needs --prefill and --decode")
    logs.configure("error")
    return run_main(_serve(args))


if __name__ == "__main__":
    raise SystemExit(main())

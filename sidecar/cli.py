"""``kvferry sidecar``: run one sidecar next to one vLLM server until SIGTERM/SIGINT.

``kvferry sidecar ARGS`` calls `main` with ARGS; `add_arguments` + `run_args`
put the same flags on any other parser.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from kvferry import flags, logs
from kvferry.tasks import run_process
from sidecar import settings as sidecar_settings
from sidecar.app import Sidecar, load_security
from sidecar.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sidecar's flags on `parser`, and ``func`` = `run_args`."""
    sidecar_settings.add_arguments(parser)
    parser.set_defaults(func=run_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvferry sidecar",
        description="Register a vLLM server with the kvferry daemon, keep it alive, tap its answers "
        "for kv_transfer_params and forward its KV events.",
    )
    logs.add_level_flag(parser)
    add_arguments(parser)
    return parser


async def run(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT, then shut down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Sidecar(settings):
        await stop.wait()
    return 0


def run_args(args: argparse.Namespace) -> int:
    """Entry point for parsed flags (what ``kvferry sidecar`` calls)."""
    flags.warn_unknown_variables("sidecar", sidecar_settings.ENV_PREFIX, args)
    try:
        settings = sidecar_settings.from_args(args)
        load_security(settings)  # (unreadable TLS files or a bad policy: said here, exit 2)
    except ValueError as e:
        print(f"kvferry sidecar: {e}", file=sys.stderr)
        return 2
    return run_process("sidecar", run(settings))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    return run_args(args)


if __name__ == "__main__":
    raise SystemExit(main())

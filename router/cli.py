"""``kvferry router``: the OpenAI-compatible front door of a P/D deployment.

Examples::

    kvferry router --daemon 127.0.0.1:50051                  # nodes from the daemon
    kvferry router --prefill http://p:8100 --decode http://d-sidecar:8200 --daemon 127.0.0.1:50051
    kvferry router --prefill http://p:8100 --decode http://d:8200   # plain P/D, no reuse
    kvferry router --listen 0.0.0.0:8000 --daemon daemon:50051 \
        --tls-ca ca.pem --tls-cert router.pem --tls-key router.key --policy policy.toml

Off loopback the router serves HTTPS (--tls-*), or plaintext with --insecure true.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from kvferry import flags, logs
from kvferry.tasks import run_process
from router.app import Router
from router.security import Security, load_security
from router.settings import ENV_PREFIX, Settings, add_arguments, from_args
from router.tokenizer import LocalTokenizer, load_tokenizer
from router.trace import check_trace_out

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvferry router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    logs.add_level_flag(p)
    add_arguments(p)
    return p


async def run(settings: Settings, security: Security, tokenizer: LocalTokenizer | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with Router(settings, security, tokenizer):
        await stop.wait()
        log.info("router.stopping")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logs.configure(args.log_level)
    flags.warn_unknown_variables("router", ENV_PREFIX, args)
    try:
        settings = from_args(args)
        check_trace_out(settings.server.trace_out)
        security = load_security(settings)  # (the TLS and policy files: PolicyError is one)
        tokenizer = load_tokenizer(settings)  # (TokenizerFilesError is one)
    except ValueError as e:
        print(f"kvferry router: {e}", file=sys.stderr)
        return 2
    return run_process("router", run(settings, security, tokenizer))


if __name__ == "__main__":
    raise SystemExit(main())

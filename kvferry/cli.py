"""The `kvferry` command: one entrypoint, one subcommand per process kind."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from kvferry import admin, logs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    parser.add_argument(
        "--log-level", default=None, help="debug, info, warning (default: $KVFERRY_LOG_LEVEL or info)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from controlplane import settings as daemon_settings

    daemon = sub.add_parser("daemon", help="run the control-plane daemon")
    daemon_settings.add_arguments(daemon)
    daemon.set_defaults(func=_daemon)

    admin.add_arguments(sub)
    return parser


def _daemon(a: argparse.Namespace) -> int:
    from controlplane import daemon, settings

    try:
        s = settings.from_args(a)
    except ValueError as e:
        print(f"kvferry daemon: {e}", file=sys.stderr)
        return 2
    return asyncio.run(daemon.run(s))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

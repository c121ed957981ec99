"""The `kvferry` command: one entrypoint, one subcommand per process kind."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvferry import flags, logs
from kvferry.tasks import run_process
from kvferry_cli import admin, plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__)
    logs.add_level_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    from controlplane import settings as daemon_settings

    daemon = sub.add_parser("daemon", help="run the control-plane daemon")
    daemon_settings.add_arguments(daemon)
    logs.add_level_flag(daemon, default=argparse.SUPPRESS)
    daemon.set_defaults(func=_daemon)

    admin.add_arguments(sub)
    plan.add_arguments(sub)
    certs = sub.add_parser(
        "certs",
        help="write a development CA, a certificate for every part and a policy naming them",
        description="For trying the secure mode; production certificates come from your own CA "
        "(cert-manager: see deploy/).",
    )
    certs.add_argument("--out", type=Path, required=True, help="directory to write them to")
    certs.add_argument(
        "--host", action="append", default=[], help="a name or address servers are reached at (repeatable)"
    )
    certs.add_argument(
        "--node",
        action="append",
        default=[],
        help="an engine id: a sidecar-ID certificate for it (repeatable)",
    )
    certs.set_defaults(func=_certs)

    # Processes with parsers of their own (main() hands them their arguments).
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _daemon(a: argparse.Namespace) -> int:
    from controlplane import daemon, settings

    flags.warn_unknown_variables("daemon", settings.ENV_PREFIX, a)
    try:
        s = settings.from_args(a)
        s.load_files()
    except ValueError as e:
        print(f"kvferry daemon: {e}", file=sys.stderr)
        return 2
    return run_process("daemon", daemon.run(s))


def _certs(a: argparse.Namespace) -> int:
    from kvferry.security.devca import make_dev_ca

    try:
        issued = make_dev_ca(a.out, tuple(a.host), tuple(a.node))
    except OSError as e:
        print(f"kvferry certs: cannot write to {a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote ca.pem and a certificate for {', '.join(issued.identities)} into {issued.out}")
    print(f"policy: {issued.out / 'policy.toml'}; an admin bearer token: {issued.out / 'admin.token'}")
    return 0


def _emulate(argv: list[str]) -> int:
    from emulator import cli as emulator_cli

    return emulator_cli.main(argv)


def _sidecar(argv: list[str]) -> int:
    from sidecar import cli as sidecar_cli

    return sidecar_cli.main(argv)


def _router(argv: list[str]) -> int:
    from router import cli as router_cli

    return router_cli.main(argv)


DELEGATED: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "sidecar": (_sidecar, "run the sidecar next to one vLLM server; see `kvferry sidecar --help`"),
    "router": (_router, "run the OpenAI-compatible P/D router; see `kvferry router --help`"),
    "emulate": (_emulate, "run a vLLM engine emulator (no GPU); see `kvferry emulate --help`"),
}


def _split_global(args: list[str]) -> tuple[list[str], list[str]]:
    """(the global options before the command, the command and what follows)."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1 if "=" in args[i] or args[i] in ("-h", "--help") else 2
    return args[:i], args[i:]


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    global_opts, rest = _split_global(args_list)
    if rest and rest[0] in DELEGATED and "-h" not in global_opts and "--help" not in global_opts:
        # Delegated processes take --log-level themselves: a global one goes after the command.
        return DELEGATED[rest[0]][0]([*global_opts, *rest[1:]] if global_opts else rest[1:])
    args = build_parser().parse_args(args_list)
    logs.configure(args.log_level)
    try:
        code: int = args.func(args)
    except BrokenPipeError:  # the reader of a long listing went away (`| head`): it has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (and the exit's flush too)
        return 0
    return code


if __name__ == "__main__":
    raise SystemExit(main())

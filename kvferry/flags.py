"""Command-line flags that default to environment variables, for every kvferry process.

`--some-flag` defaults to ``<PREFIX>SOME_FLAG`` (``KVFERRY_`` for the daemon,
``KVFERRY_SIDECAR_`` and ``KVFERRY_ROUTER_`` for the others), so the same settings
work from a shell, a systemd unit or a Kubernetes manifest. The help text names the
variable and the built-in default.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def env_name(prefix: str, flag: str) -> str:
    return prefix + flag.upper().replace("-", "_")


def finite_float(text: str) -> float:
    """A float flag's value: NaN and the infinities are refused (NaN would pass every range
    check after, each comparison with it being false)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def seconds(text: str) -> float:
    """A duration flag's value: more than 0, at most a day (a longer gRPC deadline
    overflows to one already past, and every call fails at once)."""
    value = positive_float(text)
    if value > 86400:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most 86400 (a day)")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def flag_adder(p: argparse.ArgumentParser, env_prefix: str) -> Callable[..., None]:
    """-> add(flag, default, help, kind=str): one flag whose default comes from its variable
    (argparse applies `kind` to it, so a bad value in the environment is reported like a
    bad flag)."""

    def add(flag: str, default: object, help: str, kind: Callable[[str], Any] = str) -> None:
        env = env_name(env_prefix, flag)
        p.add_argument(
            f"--{flag}",
            type=finite_float if kind is float else kind,
            default=os.environ.get(env, str(default)),
            help=f"{help} [${env}, default {default!s}]",
        )

    return add


#: Variables any kvferry process reads besides its own flags' (and the tests' own).
SHARED_VARIABLES = frozenset(
    {
        "KVFERRY_LOG_LEVEL",
        "KVFERRY_RELEASE_TICKS_S",  # (kvferry.releases: every process that sends releases)
        "KVFERRY_TEST_ETCD",  # (the test suite's)
        "KVFERRY_ENGINES",
        "KVFERRY_VLLM_PYTHON",
    }
)
#: Every process's prefix. The daemon's is a prefix of the others': their variables
#: are not the daemon's business.
PREFIXES = ("KVFERRY_", "KVFERRY_SIDECAR_", "KVFERRY_ROUTER_")
#: Parsed names no variable sets (`--log-level` reads KVFERRY_LOG_LEVEL, whatever the process).
_NOT_FROM_VARIABLES = frozenset({"LOG_LEVEL", "FUNC", "COMMAND"})
#: What Kubernetes sets in every pod for each Service ("kvferry-router" gives
#: KVFERRY_ROUTER_SERVICE_HOST, KVFERRY_ROUTER_PORT_80_TCP_ADDR, ...), unless the pod
#: says enableServiceLinks: false.
_SERVICE_LINK = re.compile(
    r"_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


def unknown_variables(
    prefix: str, args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """Set variables named like this process's flags that no flag reads -> [(name, the
    closest name a flag reads, or "")]. A misspelt one leaves its flag at the default
    without a word (a sidecar's side-channel host, say), so each process reports them."""
    env = os.environ if environ is None else environ
    known = sorted({dest.upper() for dest in vars(args)} - _NOT_FROM_VARIABLES)  # (after the prefix)
    others = tuple(p for p in PREFIXES if p != prefix and p.startswith(prefix))
    out = []
    for name in sorted(env):
        rest = name.removeprefix(prefix)
        if rest == name or rest in known or name in SHARED_VARIABLES or (others and name.startswith(others)):
            continue
        if _SERVICE_LINK.search(name):
            continue
        close = difflib.get_close_matches(rest, known, n=1, cutoff=0.75)
        out.append((name, prefix + close[0] if close else ""))
    return out


def warn_unknown_variables(process: str, prefix: str, args: argparse.Namespace) -> None:
    """One warning per variable of `unknown_variables` (the process runs as configured)."""
    for name, close in unknown_variables(prefix, args):
        log.warning(
            "config.unknown_variable",
            process=process,
            variable=name,
            hint=f"did you mean {close}?" if close else f"no {process} flag reads it; see --help",
        )

"""Command-line flags that default to environment variables, for every kvferry process.

`--some-flag` defaults to ``<PREFIX>SOME_FLAG`` (``KVFERRY_`` for the daemon,
``KVFERRY_SIDECAR_`` and ``KVFERRY_ROUTER_`` for the others), so the same settings
work from a shell, a systemd unit or a Kubernetes manifest. The help text names the
variable and the built-in default.

A process lists its flags as `Flag`s, each naming the field of its settings object
it sets: `add_flags` puts them on a parser (their defaults taken from the settings'
own), `settings_from` builds the settings from what the parser parsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = structlog.get_logger(__name__)


#: The longest duration a flag takes (a longer gRPC deadline overflows to one already
#: past, and every call fails at once).
MAX_SECONDS = 86_400.0

_Settings = TypeVar("_Settings", bound="DataclassInstance")


def env_name(prefix: str, flag: str) -> str:
    """The variable `flag` defaults to: ``<prefix>SOME_FLAG`` for ``some-flag``."""
    return prefix + flag.upper().replace("-", "_")


def finite_float(text: str) -> float:
    """A float flag's value: NaN and the infinities are refused (NaN would pass every range
    check after, each comparison with it being false)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def positive_float(text: str) -> float:
    """A float flag's value that must be more than 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def seconds(text: str) -> float:
    """A duration flag's value: more than 0, at most `MAX_SECONDS` (a day)."""
    value = positive_float(text)
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {MAX_SECONDS:.0f} (a day)")
    return value


def non_negative_int(text: str) -> int:
    """An integer flag's value that must be 0 or more."""
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


def boolean(text: str) -> bool:
    """A true/false flag's value: 1, true, yes, on or 0, false, no, off (any case)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def bool_text(value: bool) -> str:
    """A boolean default as its flag reads it."""
    return "true" if value else "false"


def items(text: str) -> tuple[str, ...]:
    """The comma-separated items of a flag's value, stripped, empty ones left out."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def joined(values: Sequence[str]) -> str:
    """Items as one flag value, comma-separated (what `items` reads)."""
    return ",".join(values)


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the settings field it sets."""

    name: str
    """The flag without its dashes ("engine-url"); its variable ends in ENGINE_URL."""
    field: str
    """The field it sets: "group.field" of the settings object."""
    help: str
    """Its line in --help (the variable and the default are added)."""
    kind: Callable[[str], Any] = str
    """Parses its text, from the command line, the variable or the default alike (float:
    `finite_float`)."""
    to_field: Callable[[Any], Any] | None = None
    """The field's value from the parsed one (None: the parsed one as it is)."""
    to_text: Callable[[Any], object] = str
    """The default's text (shown in --help, and parsed) from the field's default value."""

    @property
    def dest(self) -> str:
        """The attribute argparse parses it into."""
        return self.name.replace("-", "_")


def _field_path(flag: Flag) -> tuple[str, str]:
    group, _, name = flag.field.partition(".")
    if not group or not name or "." in name:
        raise ValueError(f"flag --{flag.name}: field {flag.field!r} is not group.field")
    return group, name


def add_flags(p: argparse.ArgumentParser, env_prefix: str, flags: Sequence[Flag], defaults: object) -> None:
    """Put `flags` on `p`, each defaulting to its variable, then to its field in `defaults`."""
    add = flag_adder(p, env_prefix)
    for flag in flags:
        group, name = _field_path(flag)
        default = getattr(getattr(defaults, group), name)  # (a mistyped field fails here)
        add(flag.name, flag.to_text(default), flag.help, flag.kind)


def settings_from(args: argparse.Namespace, flags: Sequence[Flag], defaults: _Settings) -> _Settings:
    """`defaults` with the field of every flag set from `args` (parsed by a parser `add_flags`
    made); fields no flag sets keep their default."""
    groups: dict[str, dict[str, Any]] = {}
    for flag in flags:
        group, name = _field_path(flag)
        value = getattr(args, flag.dest)
        groups.setdefault(group, {})[name] = value if flag.to_field is None else flag.to_field(value)
    changes = {
        group: dataclasses.replace(getattr(defaults, group), **fields) for group, fields in groups.items()
    }
    return dataclasses.replace(defaults, **changes)


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

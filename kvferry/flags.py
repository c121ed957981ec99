"""Command-line flags that default to environment variables, for every kvferry process.

`--some-flag` defaults to ``<PREFIX>SOME_FLAG`` (``KVFERRY_`` for the daemon,
``KVFERRY_SIDECAR_`` and ``KVFERRY_ROUTER_`` for the others), so the same settings
work from a shell, a systemd unit or a Kubernetes manifest. The help text names the
variable and the built-in default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env_name(prefix: str, flag: str) -> str:
    return prefix + flag.upper().replace("-", "_")


def flag_adder(p: argparse.ArgumentParser, env_prefix: str) -> Callable[..., None]:
    """-> add(flag, default, help, kind=str): one flag whose default comes from its variable
    (argparse applies `kind` to it, so a bad value in the environment is reported like a
    bad flag)."""

    def add(flag: str, default: object, help: str, kind: Callable[[str], Any] = str) -> None:
        env = env_name(env_prefix, flag)
        p.add_argument(
            f"--{flag}",
            type=kind,
            default=os.environ.get(env, str(default)),
            help=f"{help} [${env}, default {default!s}]",
        )

    return add

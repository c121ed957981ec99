"""How the admin commands reach a daemon that lets no one in: TLS (the daemon's CA, and a
client certificate naming the operator) and a bearer token of the policy.

`--tls-ca` alone verifies the daemon and presents no certificate: with `--token` that is
what the daemon's token port (`--token-listen`) takes. `--token` defaults to
$KVFERRY_TOKEN; it goes in an `authorization: Bearer` header on every call.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

TOKEN_VARIABLE = "KVFERRY_TOKEN"


def add_flags(p: argparse.ArgumentParser) -> None:
    """The TLS and token flags of every command that talks to the daemon."""
    p.add_argument("--tls-ca", type=Path, default=None, help="CA of the daemon's certificate (TLS on)")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate naming you (PEM)")
    p.add_argument("--tls-key", type=Path, default=None, help="its private key (PEM)")
    p.add_argument(
        "--token",
        default=os.environ.get(TOKEN_VARIABLE, ""),
        help=f"bearer token of the daemon's policy [${TOKEN_VARIABLE}]",
    )


def credentials(a: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """The channel's TLS credentials (None: plaintext). Raises ValueError naming a flag
    given without its partner, or a file that cannot be read."""
    if (a.tls_cert is None) != (a.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if a.tls_ca is None:
        if a.tls_cert is not None:
            raise ValueError("--tls-cert needs --tls-ca: the CA of the daemon's certificate")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(a.tls_ca, "--tls-ca"),
        private_key=_read(a.tls_key, "--tls-key") if a.tls_key else None,
        certificate_chain=_read(a.tls_cert, "--tls-cert") if a.tls_cert else None,
    )


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from e


def daemon_channel(a: argparse.Namespace) -> grpc.Channel:
    """A channel to `a.daemon` as the flags say: TLS or plaintext, with the token or without."""
    creds = credentials(a)
    channel = grpc.insecure_channel(a.daemon) if creds is None else grpc.secure_channel(a.daemon, creds)
    if not a.token:
        return channel
    return grpc.intercept_channel(channel, _BearerToken(a.token))


class _BearerToken(grpc.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Adds `authorization: Bearer <token>` to each call (over plaintext too: a daemon on
    loopback with a policy takes tokens, and gRPC's call credentials need TLS)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], details: Any, request: Any
    ) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return continuation(details._replace(metadata=metadata), request)

"""The router's security material, read from the files its settings name: the TLS
contexts of its HTTPS front door and of its connections to sidecars and engines, the
API keys clients may present (`--api-key`, and the policy file's ``[clients.*]``), and
the watch that follows certificate rotation.

Clients authenticate with API keys, not certificates: the front door asks for none
(one a client presents is verified all the same). To the daemon, sidecars and engines
the router's certificate is its identity (mTLS). Rotated files are loaded into both
SSL contexts (the next handshake uses them; pooled connections keep theirs until they
close) and the daemon's channels are re-made (`DaemonClient.rotate_if_changed`).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvferry.security.policy import load_policy
from kvferry.security.tls import (
    CertReloader,
    TlsFiles,
    check_listen,
    client_ssl_context,
    server_ssl_context,
)
from router.daemon_client import DaemonClient
from router.identity import ApiKeys
from router.settings import Settings

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Security:
    """What the router's TLS and key settings load to."""

    tls: TlsFiles | None
    """The router's certificate, key and CA (None: plaintext, development)."""
    keys: ApiKeys
    """The API keys clients may present, and their tenants."""
    server_ssl: ssl.SSLContext | None = None
    """The HTTPS front door's context (client certificates optional)."""
    client_ssl: ssl.SSLContext | None = None
    """The context of the connections to sidecars and engines (https:// URLs)."""

    @property
    def scheme(self) -> str:
        """The front door's URL scheme."""
        return "https" if self.tls is not None else "http"


def load_security(settings: Settings) -> Security:
    """Read the TLS files and the policy file `settings` name; ValueError (a
    `kvferry.security.policy.PolicyError` for the policy) saying what is wrong."""
    sec = settings.security
    tls = sec.tls_files()
    policy = load_policy(Path(sec.policy)) if sec.policy else None
    keys = ApiKeys.of(settings.server.api_keys, policy.clients if policy is not None else None)
    if tls is None:
        if check_listen(settings.server.listen, None, insecure=False) is not None:  # (--insecure)
            log.warning("router.insecure", listen=settings.server.listen, detail="plaintext off loopback")
        return Security(None, keys)
    try:
        server, client = server_ssl_context(tls, require_client_cert=False), client_ssl_context(tls)
    except (OSError, ValueError) as e:  # (ssl.SSLError is an OSError)
        raise ValueError(f"TLS files {tls.cert}, {tls.key}, {tls.ca} do not load: {e}") from e
    return Security(tls, keys, server, client)


async def follow_rotation(security: Security, daemon: DaemonClient | None, interval_s: float) -> None:
    """Every `interval_s`: load rotated TLS files into the SSL contexts, and re-make the
    daemon's channels with them. Runs until cancelled; nothing to do without TLS."""
    tls = security.tls
    if tls is None:
        return
    contexts = [c for c in (security.server_ssl, security.client_ssl) if c is not None]
    # (their own TlsFiles each: a change is seen once per watcher)
    reloader = CertReloader(TlsFiles(tls.ca, tls.cert, tls.key), contexts, interval_s)
    reloader.reload_if_changed()  # (the files as loaded: seen)
    while True:
        await asyncio.sleep(interval_s)
        reloader.reload_if_changed()
        if daemon is not None:
            daemon.rotate_if_changed()

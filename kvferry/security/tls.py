"""TLS for every hop: the files, SSL contexts and gRPC credentials that follow rotation,
a connection's peer identity, and the rule that plaintext stays on loopback.

Certificates rotate under the processes (cert-manager rewrites the mounted files): servers
read the files again on the first handshake after they change (gRPC's dynamic
credentials; `CertReloader` for the aiohttp servers' and clients' SSL contexts), and gRPC
clients re-make their channel when `TlsFiles.changed()` says so. A half-written set of
files fails to load and is tried again later; the previous certificate stays in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvferry.urls import listen_host_port

log = structlog.get_logger("kvferry.security")

RELOAD_CHECK_S = 10.0
"""How often a CertReloader looks at the files' modification times."""


@dataclass(frozen=True)
class TlsFiles:
    """A process's certificate (PEM), its key, and the CA it trusts for its peers."""

    ca: Path
    cert: Path
    key: Path
    _seen: list[tuple[int, ...]] = field(default_factory=list, compare=False, repr=False)

    @staticmethod
    def from_flags(ca: str | Path | None, cert: str | Path | None, key: str | Path | None) -> TlsFiles | None:
        """All three files, or None for none; one or two of them is a ValueError naming the rest."""
        given = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        if not any(given.values()):
            return None
        missing = [flag for flag, v in given.items() if not v]
        if missing:
            raise ValueError(
                f"TLS needs --tls-ca, --tls-cert and --tls-key together; missing {', '.join(missing)}"
            )
        files = TlsFiles(Path(str(ca)), Path(str(cert)), Path(str(key)))
        files.read()  # (unreadable files are an error at start, not at the first handshake)
        files.changed()
        return files

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) PEM bytes; ValueError naming an unreadable file."""
        out = []
        for p in (self.ca, self.cert, self.key):
            try:
                out.append(p.read_bytes())
            except OSError as e:
                raise ValueError(f"TLS file {p}: {e.strerror or e}") from e
        return out[0], out[1], out[2]

    def _stamp(self) -> tuple[int, ...]:
        stamp: list[int] = []
        for p in (self.ca, self.cert, self.key):
            try:
                st = p.stat()
                stamp += [st.st_mtime_ns, st.st_size, st.st_ino]
            except OSError:
                stamp += [-1, -1, -1]
        return tuple(stamp)

    def forget(self) -> None:
        """Make the next `changed()` True (the files failed to load: try them again)."""
        self._seen.clear()

    def watch(self) -> TlsFiles:
        """The same files, for one more watcher: `changed()` answers each watcher once, so
        every end that follows a rotation needs a `TlsFiles` of its own (they are as now)."""
        own = TlsFiles(self.ca, self.cert, self.key)
        own.changed()
        return own

    def changed(self) -> bool:
        """True when the files changed since the last call (the first call: True)."""
        now = self._stamp()
        if self._seen and self._seen[-1] == now:
            return False
        self._seen[:] = [now]
        return True


def is_loopback(host: str) -> bool:
    """A host only this machine reaches: localhost or a loopback address."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(listen: str, tls: TlsFiles | None, insecure: bool, flag: str = "--listen") -> str | None:
    """Why a server may not listen on `listen` as configured (None: it may). Plaintext is
    for loopback; elsewhere it needs TLS, or --insecure to say it is meant."""
    if tls is not None or insecure:
        return None
    host, _ = listen_host_port(listen)
    if is_loopback(host):
        return None
    return (
        f"{flag} {listen} is not a loopback address and no TLS is configured: give --tls-ca, "
        "--tls-cert and --tls-key (see `kvferry certs`), or --insecure to serve plaintext anyway"
    )


def _load(ctx: ssl.SSLContext, files: TlsFiles) -> None:
    ctx.load_cert_chain(files.cert, files.key)
    ctx.load_verify_locations(cafile=files.ca)


def server_ssl_context(files: TlsFiles, require_client_cert: bool) -> ssl.SSLContext:
    """An aiohttp server's context: this process's certificate; clients' certificates
    verified against the CA, and required when `require_client_cert` (else optional)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, files)
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """An aiohttp client's context: servers verified against the CA (and their names),
    this process's certificate presented as its identity."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, files)
    return ctx


class CertReloader:
    """Loads rotated files into SSL contexts: an asyncio task checking every `interval_s`.
    CAs are added, never dropped, until the process restarts (a CA rotation overlaps)."""

    def __init__(
        self, files: TlsFiles, contexts: Iterable[ssl.SSLContext], interval_s: float = RELOAD_CHECK_S
    ):
        self._files = files
        self._contexts = list(contexts)
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0

    def reload_if_changed(self) -> bool:
        """Load the files into every context if they changed; True when it did."""
        if not self._files.changed():
            return False
        try:
            for ctx in self._contexts:
                _load(ctx, self._files)
        except (OSError, ssl.SSLError, ValueError) as e:
            self._files.forget()  # (try again next time: the files may be half-written)
            log.warning("tls.reload_failed", cert=str(self._files.cert), error=str(e))
            return False
        self.reloads += 1
        log.info("tls.reloaded", cert=str(self._files.cert))
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tls-reload")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self.reload_if_changed()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _server_config(files: TlsFiles) -> Any:
    ca, cert, key = files.read()
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def grpc_server_credentials(files: TlsFiles, require_client_cert: bool) -> grpc.ServerCredentials:
    """A gRPC server's credentials, read again on the first handshake after the files change."""
    files = files.watch()  # (its own: another port or the peers' channels see the change too)

    def fetch() -> Any:
        if not files.changed():
            return None
        try:
            return _server_config(files)
        except ValueError as e:
            files.forget()
            log.warning("tls.reload_failed", cert=str(files.cert), error=str(e))
            return None

    return grpc.dynamic_ssl_server_credentials(
        _server_config(files), fetch, require_client_authentication=require_client_cert
    )


def grpc_channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A gRPC client's credentials: the server verified against the CA, this process's
    certificate presented."""
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def peer_identity_from_grpc(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The Common Name of the client certificate the TLS handshake verified (None: none)."""
    names = list(context.auth_context().get("x509_common_name") or [])
    return names[0].decode() if names else None


def peer_identity_from_transport(transport: asyncio.BaseTransport | None) -> str | None:
    """The Common Name of a verified client certificate on an aiohttp connection (None: none)."""
    cert = transport.get_extra_info("peercert") if transport is not None else None
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def bearer_token(value: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` value ("" = none)."""
    scheme, _, token = (value or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""

"""The framed Leases/Stream (--stream-listen) lets in whom gRPC's Leases/Stream lets in, and
no one else: a client certificate of the CA is required, the policy names the caller (its
bearer token first), the role must allow the method, and every op is checked as on gRPC.
Each refusal with its status, its message and an audit line. Real certificates of the
development CA and a real daemon, as test_auth.py."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from controlplane.daemon import Daemon
from controlplane.settings import SecuritySettings
from kvferry.framedstream import FramedCall
from kvferry.leaseclient import LeaseOpError, LeaseStream
from kvferry.security.tls import TlsFiles, client_ssl_context
from tests.conftest import DaemonFactory, daemon_settings
from tests.controlplane.test_auth import READER_TOKEN, As, _denials, certs  # noqa: F401 - (a fixture)
from tests.factories import lease_request, lookup_request, node_request

Open = Callable[..., LeaseStream]


@pytest.fixture
async def secure(make_daemon: DaemonFactory, etcd_endpoint: str, certs: Path) -> Daemon:  # noqa: F811
    """A daemon with mTLS and the policy, serving the framed stream beside gRPC."""
    security = SecuritySettings(
        tls_ca=certs / "ca.pem",
        tls_cert=certs / "daemon.pem",
        tls_key=certs / "daemon.key",
        policy=certs / "policy.toml",
    )
    base = daemon_settings(etcd_endpoint)
    return await make_daemon(
        replace(base, security=security, server=replace(base.server, stream_listen="127.0.0.1:0"))
    )


@pytest.fixture
async def as_(secure: Daemon, certs: Path) -> AsyncIterator[Open]:  # noqa: F811
    """A framed LeaseStream to `secure` as an identity: its certificate (None: none), a token."""
    made: list[LeaseStream] = []

    def open_as(name: str | None, token: str = "", certs_dir: Path = certs) -> LeaseStream:
        files = TlsFiles(certs / "ca.pem", certs_dir / f"{name}.pem", certs_dir / f"{name}.key")
        ctx = client_ssl_context(files) if name else _no_certificate(certs)
        auth = f"Bearer {token}" if token else ""
        made.append(LeaseStream(None, opener=lambda: FramedCall("127.0.0.1", secure.stream_port, ctx, auth)))
        return made[-1]

    yield open_as
    for s in made:
        await s.close()


def _no_certificate(certs_dir: Path) -> ssl.SSLContext:
    """A client that trusts the daemon's CA and has no certificate of its own."""
    return ssl.create_default_context(cafile=str(certs_dir / "ca.pem"))


async def _refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(LeaseOpError) as info:
        await call
    assert info.value.code == code, info.value.message
    return info.value.message


async def test_strangers_get_no_stream(as_: Open, certs: Path) -> None:  # noqa: F811
    # No client certificate: TLS refuses before a frame is read.
    await _refused(as_(None).lookup(lookup_request("c"), 10), grpc.StatusCode.UNAVAILABLE)
    # Another CA's certificate: the same.
    await _refused(
        as_("router", certs_dir=certs / "other").lookup(lookup_request("c"), 10), grpc.StatusCode.UNAVAILABLE
    )
    # A certificate of the CA that the policy does not name.
    with capture_logs() as logs:
        message = await _refused(
            as_("sidecar-stranger").lookup(lookup_request("c"), 10), grpc.StatusCode.UNAUTHENTICATED
        )
    assert "certificate CN 'sidecar-stranger' is not an identity of the policy" in message
    assert _denials(logs) == [("-", "/kvferry.v1.Leases/Stream", "unauthenticated")]
    # A bearer token the policy lacks is refused, not passed over for the certificate.
    message = await _refused(
        as_("router", token="not-a-token").lookup(lookup_request("c"), 10), grpc.StatusCode.UNAUTHENTICATED
    )
    assert "bearer token is not one of the policy's" in message
    # A reader's token: its role may not use Leases/Stream.
    with capture_logs() as logs:
        message = await _refused(
            as_("router", token=READER_TOKEN).lookup(lookup_request("c"), 10),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    assert "may not call /kvferry.v1.Leases/Stream" in message
    assert _denials(logs) == [("grafana", "/kvferry.v1.Leases/Stream", "permission_denied")]


async def test_each_op_is_checked_as_on_grpc(as_: Open, secure: Daemon, certs: Path) -> None:  # noqa: F811
    d1, router = as_("sidecar-d1"), as_("router")
    grpc_d1 = As(f"127.0.0.1:{secure.port}", certs, "sidecar-d1")
    try:
        await grpc_d1.nodes.Register(node_request("d1"), timeout=10)
    finally:
        await grpc_d1.channel.close()
    # A sidecar registers its own node's retentions only, and looks nothing up.
    await d1.register(lease_request("conv-1", "d1", tenant="acme"), 10)
    message = await _refused(
        d1.register(lease_request("conv-2", "d0", tenant="acme"), 10), grpc.StatusCode.PERMISSION_DENIED
    )
    assert "d0" in message
    await _refused(d1.lookup(lookup_request("conv-1", tenant="acme"), 10), grpc.StatusCode.PERMISSION_DENIED)
    # A router looks up its own tenants' conversations only, and registers nothing.
    await _refused(
        router.lookup(lookup_request("conv-1", tenant="other"), 10), grpc.StatusCode.PERMISSION_DENIED
    )
    await _refused(
        router.register(lease_request("conv-3", "d1", tenant="acme"), 10), grpc.StatusCode.PERMISSION_DENIED
    )
    answer = await router.lookup(lookup_request("conv-1", tenant="acme"), 10)
    assert answer.reason == "pull"

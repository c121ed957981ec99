"""TLS on every hop: mutual TLS with identities, rotation without a restart, the dev CA,
and the rule that plaintext stays on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvferry.channels import daemon_channel
from kvferry.security.devca import make_dev_ca
from kvferry.security.policy import load_policy
from kvferry.security.roles import Role
from kvferry.security.tls import (
    CertReloader,
    TlsFiles,
    bearer_token,
    check_listen,
    client_ssl_context,
    grpc_server_credentials,
    peer_identity_from_grpc,
    peer_identity_from_transport,
    server_ssl_context,
)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ca")
    make_dev_ca(out, hosts=("kvferry.internal",), nodes=("d0",))
    return out


def files(ca: Path, name: str) -> TlsFiles:
    f = TlsFiles.from_flags(ca / "ca.pem", ca / f"{name}.pem", ca / f"{name}.key")
    assert f is not None
    return f


def test_the_dev_ca_issues_every_part_and_a_policy_naming_them(ca: Path) -> None:
    root = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
    for name in ("daemon", "router", "admin", "reader", "etcd", "sidecar-d0"):
        cert = x509.load_pem_x509_certificate((ca / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(root)
        assert (
            cert.subject.rfc4514_string().startswith(f"O=kvferry dev,CN={name}")
            or name in cert.subject.rfc4514_string()
        )
        assert (ca / f"{name}.key").stat().st_mode & 0o077 == 0  # (keys readable by the owner only)
    sans = x509.load_pem_x509_certificate(
        (ca / "daemon.pem").read_bytes()
    ).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "kvferry.internal" in sans.value.get_values_for_type(x509.DNSName)
    policy = load_policy(ca / "policy.toml")
    sidecar = policy.by_certificate("sidecar-d0")
    assert sidecar is not None and sidecar.node == "d0"
    admin = policy.by_token((ca / "admin.token").read_text().strip())
    assert admin is not None and admin.role is Role.ADMIN
    assert policy.by_certificate("etcd") is None  # (etcd's certificate names no kvferry caller)


def test_bearer_tokens_never_read_as_a_flag() -> None:
    """`--token TOKEN` took a token starting with "-" for a flag (argparse: "expected one
    argument"); the tokens `kvferry certs` makes start with their prefix."""
    import argparse

    from kvferry.security.devca import TOKEN_PREFIX, new_token

    tokens = {new_token() for _ in range(2000)}
    assert len(tokens) == 2000 and all(t.startswith(TOKEN_PREFIX) and len(t) > 40 for t in tokens)
    p = argparse.ArgumentParser()
    p.add_argument("--token")
    assert all(p.parse_args(["--token", t]).token == t for t in list(tokens)[:200])


def test_tls_flags_come_all_three_or_none(ca: Path, tmp_path: Path) -> None:
    assert TlsFiles.from_flags(None, None, None) is None
    with pytest.raises(ValueError, match="missing --tls-key"):
        TlsFiles.from_flags(ca / "ca.pem", ca / "router.pem", None)
    with pytest.raises(ValueError, match=r"absent\.pem"):
        TlsFiles.from_flags(ca / "ca.pem", tmp_path / "absent.pem", ca / "router.key")


@pytest.mark.parametrize(
    ("listen", "refused"),
    [
        ("127.0.0.1:1", False),
        ("localhost:1", False),
        ("[::1]:1", False),
        ("0.0.0.0:1", True),
        (":1", True),
        ("10.0.0.5:1", True),
    ],
)
def test_plaintext_stays_on_loopback(listen: str, refused: bool, ca: Path) -> None:
    why = check_listen(listen, None, insecure=False)
    assert (why is not None) == refused
    if why:
        assert "--tls-cert" in why and "--insecure" in why and listen in why
    assert check_listen(listen, None, insecure=True) is None
    assert check_listen(listen, files(ca, "daemon"), insecure=False) is None


def test_bearer_tokens() -> None:
    assert bearer_token("Bearer abc ") == "abc" and bearer_token("bearer abc") == "abc"
    assert bearer_token("Basic abc") == "" and bearer_token(None) == ""


@contextlib.asynccontextmanager
async def _https_server(ctx: ssl.SSLContext) -> AsyncIterator[int]:
    async def who(request: web.Request) -> web.Response:
        return web.json_response({"cn": peer_identity_from_transport(request.transport)})

    app = web.Application()
    app.router.add_get("/who", who)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_mutual_tls_names_the_client_and_refuses_strangers(ca: Path, tmp_path: Path) -> None:
    server = server_ssl_context(files(ca, "sidecar-d0"), require_client_cert=True)
    async with _https_server(server) as port:
        url = f"https://localhost:{port}/who"
        async with aiohttp.ClientSession() as s:
            async with s.get(url, ssl=client_ssl_context(files(ca, "router"))) as r:
                assert (await r.json()) == {"cn": "router"}
            no_cert = ssl.create_default_context(cafile=ca / "ca.pem")
            with pytest.raises(aiohttp.ClientError):
                async with s.get(url, ssl=no_cert) as r:
                    await r.read()
            other = tmp_path / "other"
            make_dev_ca(other)  # (a certificate from another CA)
            with pytest.raises(aiohttp.ClientError):
                async with s.get(
                    url,
                    ssl=client_ssl_context(
                        TlsFiles(ca / "ca.pem", other / "router.pem", other / "router.key")
                    ),
                ) as r:
                    await r.read()


async def test_a_rotated_certificate_is_served_without_a_restart(ca: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for suffix in ("pem", "key"):
        shutil.copy(ca / f"sidecar-d0.{suffix}", live / f"server.{suffix}")
    f = TlsFiles.from_flags(ca / "ca.pem", live / "server.pem", live / "server.key")
    assert f is not None
    ctx = server_ssl_context(f, require_client_cert=False)
    reloader = CertReloader(f, [ctx], interval_s=3600)
    assert not reloader.reload_if_changed()
    async with _https_server(ctx) as port:

        async def served_serial() -> int:
            _, writer = await asyncio.open_connection(
                "localhost", port, ssl=client_ssl_context(files(ca, "router"))
            )
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            writer.close()
            return x509.load_der_x509_certificate(der).serial_number

        first = await served_serial()
        (live / "server.pem").write_text("-----BEGIN CERT")  # (half-written: kept the old one)
        assert not reloader.reload_if_changed()
        assert await served_serial() == first
        for suffix in ("pem", "key"):
            shutil.copy(ca / f"daemon.{suffix}", live / f"server.{suffix}")
        assert reloader.reload_if_changed() and reloader.reloads == 1
        rotated = x509.load_pem_x509_certificate((ca / "daemon.pem").read_bytes()).serial_number
        assert await served_serial() == rotated != first


async def test_grpc_mutual_tls_and_rotation(ca: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for suffix in ("pem", "key"):
        shutil.copy(ca / f"sidecar-d0.{suffix}", live / f"server.{suffix}")
    seen: list[str | None] = []

    class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
        async def Check(
            self, request: object, context: grpc.aio.ServicerContext[object, object]
        ) -> health_pb2.HealthCheckResponse:
            seen.append(peer_identity_from_grpc(context))
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    f = TlsFiles.from_flags(ca / "ca.pem", live / "server.pem", live / "server.key")
    assert f is not None
    port = server.add_secure_port("127.0.0.1:0", grpc_server_credentials(f, require_client_cert=True))
    await server.start()
    try:

        async def check(name: str) -> None:
            async with daemon_channel(f"localhost:{port}", files(ca, name)) as ch:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)

        await check("router")
        for suffix in ("pem", "key"):
            shutil.copy(ca / f"daemon.{suffix}", live / f"server.{suffix}")
        await check("admin")  # (the new certificate is from the same CA: still trusted)
        assert seen == ["router", "admin"]
        ctx = client_ssl_context(files(ca, "router"))
        ctx.set_alpn_protocols(["h2"])
        _, writer = await asyncio.open_connection("localhost", port, ssl=ctx)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        served = x509.load_der_x509_certificate(der).serial_number
        assert served == x509.load_pem_x509_certificate((ca / "daemon.pem").read_bytes()).serial_number
        no_cert = grpc.ssl_channel_credentials(root_certificates=(ca / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{port}", no_cert) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)

"""The sidecar under a policy, over TLS (issue 21): each attack on its port, refused.

Certificates come from the development CA (`kvferry.security.devca`), made once per
session; the policy is the test's own (a router limited to tenant acme). Everything is
real: the tap serves HTTPS, clients present certificates or tokens, the gRPC server
the sidecar's daemon link talks to checks the client certificate.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import structlog

from kvferry.security.devca import Issued, make_dev_ca
from kvferry.security.policy import digest
from kvferry.security.roles import Caller, Role
from kvferry.security.tls import TlsFiles, grpc_server_credentials, peer_identity_from_grpc
from kvferry.turnheaders import TENANT_HEADER, TURN_ID_HEADER
from kvferry.v1 import nodes_pb2
from sidecar import Sidecar
from sidecar.access import caller_of, tenant_of
from sidecar.cli import build_parser, run_args
from sidecar.daemon import DaemonLink
from sidecar.settings import SecuritySettings, Settings, TapSettings, from_args
from tests.sidecar.conftest import EchoEngine, StartTap

POLICY = """
[identities.router]
role = "router"
tenants = ["acme"]
[identities.admin]
role = "admin"
[identities.reader]
role = "reader"
tenants = ["acme"]
[identities.sidecar-d0]
role = "sidecar"
node = "d0"
[identities.alice]
role = "admin"
token_sha256 = "{token}"
"""


@pytest.fixture(scope="session")
def dev_ca(tmp_path_factory: pytest.TempPathFactory) -> Issued:
    """A development CA with certificates for every part and an engine d0, and a policy."""
    issued = make_dev_ca(tmp_path_factory.mktemp("ca"), nodes=("d0",))
    (issued.out / "sidecar-policy.toml").write_text(POLICY.format(token=digest(issued.admin_token)))
    return issued


@pytest.fixture(scope="session")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Issued:
    """Another CA: its certificates are no one's."""
    return make_dev_ca(tmp_path_factory.mktemp("other-ca"))


def tls_flags(ca: Issued, name: str = "sidecar-d0") -> dict[str, Any]:
    """`sidecar_settings` keywords: TLS with `name`'s certificate and the test's policy."""
    return {
        "security__tls_ca": str(ca.out / "ca.pem"),
        "security__tls_cert": str(ca.out / f"{name}.pem"),
        "security__tls_key": str(ca.out / f"{name}.key"),
        "security__policy": str(ca.out / "sidecar-policy.toml"),
    }


def client(ca: Issued, name: str | None, trusted: Issued | None = None) -> ssl.SSLContext:
    """A client's context: it trusts `trusted`'s CA (default `ca`'s), presents `name`'s certificate."""
    ctx = ssl.create_default_context(cafile=(trusted or ca).out / "ca.pem")
    if name is not None:
        ctx.load_cert_chain(ca.out / f"{name}.pem", ca.out / f"{name}.key")
    return ctx


@pytest.fixture
async def secure(start_tap: StartTap, dev_ca: Issued) -> Sidecar:
    return await start_tap(**tls_flags(dev_ca))


async def _call(
    http: aiohttp.ClientSession,
    sc: Sidecar,
    ctx: ssl.SSLContext,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with http.request(method, sc.url + path, ssl=ctx, json={"prompt": "hi"}, headers=headers) as r:
        body = await r.json(content_type=None) if r.content_type.endswith("json") else await r.text()
        return r.status, body


def _error(body: Any) -> str:
    return str(body["error"]["message"])


async def test_anonymous_callers_are_refused_but_for_health(
    secure: Sidecar, dev_ca: Issued, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    assert secure.url.startswith("https://")
    nobody = client(dev_ca, None)
    with structlog.testing.capture_logs() as logs:
        status, body = await _call(http, secure, nobody, "POST", "/v1/completions")
    assert status == 401 and _error(body) == (
        "no identity: present a client certificate or a bearer token of the policy"
    )
    denied = [e for e in logs if e["event"] == "audit.denied"]
    assert denied and denied[0]["identity"] == "-" and denied[0]["action"] == "POST /v1/completions"
    assert (await _call(http, secure, nobody, "GET", "/health"))[0] == 200  # (probes carry no certificate)
    status, body = await _call(
        http, secure, nobody, "POST", "/v1/completions", {"Authorization": "Bearer guess"}
    )
    assert status == 401 and _error(body) == "no identity: the bearer token is not one of the policy's"
    status, body = await _call(http, secure, client(dev_ca, "etcd"), "GET", "/kvferry/metrics")
    assert (
        status == 401
        and _error(body) == "no identity: certificate CN 'etcd' is not an identity of the policy"
    )
    assert echo.seen == []


async def test_a_certificate_of_another_ca_gets_no_connection(
    secure: Sidecar, dev_ca: Issued, other_ca: Issued, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(aiohttp.ClientError):
        await _call(http, secure, client(other_ca, "router", trusted=dev_ca), "POST", "/v1/completions")


async def test_each_role_gets_its_paths(
    secure: Sidecar, dev_ca: Issued, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    router, reader, admin = client(dev_ca, "router"), client(dev_ca, "reader"), client(dev_ca, "admin")
    assert (await _call(http, secure, router, "POST", "/v1/completions"))[0] == 200
    status, body = await _call(http, secure, router, "POST", "/reset_prefix_cache")
    assert status == 403 and _error(body) == (
        "identity 'router' (role router) may not call POST /reset_prefix_cache: it needs role admin"
    )
    status, body = await _call(http, secure, reader, "POST", "/v1/chat/completions")
    assert status == 403 and _error(body) == (
        "identity 'reader' (role reader) may not call /v1/chat/completions: "
        "it needs role router, sidecar or admin"
    )
    assert (await _call(http, secure, reader, "GET", "/kvferry/metrics"))[0] == 200
    with structlog.testing.capture_logs() as logs:
        assert (await _call(http, secure, admin, "POST", "/reset_prefix_cache"))[0] == 200
    allowed = [e for e in logs if e["event"] == "audit.allowed"]
    assert (
        allowed and allowed[0]["identity"] == "admin" and allowed[0]["action"] == "POST /reset_prefix_cache"
    )
    assert echo.seen == ["POST /v1/completions", "POST /reset_prefix_cache"]


async def test_an_admin_token_works_without_a_certificate_and_stays_with_the_tap(
    secure: Sidecar, dev_ca: Issued, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    token = {"Authorization": f"Bearer {dev_ca.admin_token}"}
    status, body = await _call(http, secure, client(dev_ca, None), "POST", "/reset_prefix_cache", token)
    assert status == 200 and "Authorization" not in body["headers"]
    # A router's Authorization (vLLM's --api-key) is the engine's: its certificate names it.
    key = {"Authorization": "Bearer engine-key"}
    status, body = await _call(http, secure, client(dev_ca, "router"), "POST", "/v1/completions", key)
    assert status == 200 and body["headers"]["Authorization"] == "Bearer engine-key"


async def test_the_tenant_comes_only_from_a_router_allowed_it(
    secure: Sidecar, dev_ca: Issued, echo: EchoEngine, http: aiohttp.ClientSession
) -> None:
    router, sidecar = client(dev_ca, "router"), client(dev_ca, "sidecar-d0")

    def turn(tenant: str) -> dict[str, str]:
        return {TURN_ID_HEADER: "t-1", TENANT_HEADER: tenant}

    assert (await _call(http, secure, router, "POST", "/v1/completions", turn("acme")))[0] == 200
    status, body = await _call(http, secure, router, "POST", "/v1/completions", turn("globex"))
    assert status == 403 and _error(body) == "identity 'router' (role router) may not act for tenant 'globex'"
    status, body = await _call(http, secure, sidecar, "POST", "/v1/completions", turn("acme"))
    assert status == 403 and _error(body) == (
        "identity 'sidecar-d0' (role sidecar) may not name a tenant: only a router may"
    )
    # The header a front door of another kind names the tenant in: the same rule.
    status, _ = await _call(http, secure, sidecar, "POST", "/v1/completions", {TENANT_HEADER: "acme"})
    assert status == 403
    assert (await _call(http, secure, sidecar, "POST", "/v1/completions"))[0] == 200  # (a release: no tenant)
    assert echo.seen == ["POST /v1/completions", "POST /v1/completions"]


def _install(ca: Issued, name: str, into: Path) -> None:
    """Put `name`'s certificate and key at into/tls.pem and into/tls.key, as a rotation does
    (new files moved over the old)."""
    for suffix in ("pem", "key"):
        shutil.copy(ca.out / f"{name}.{suffix}", into / f"new.{suffix}")
        os.replace(into / f"new.{suffix}", into / f"tls.{suffix}")


async def test_the_taps_certificate_is_reloaded_when_its_files_change(
    start_tap: StartTap, dev_ca: Issued, tmp_path: Path
) -> None:
    _install(dev_ca, "sidecar-d0", tmp_path)
    flags = {"security__tls_cert": str(tmp_path / "tls.pem"), "security__tls_key": str(tmp_path / "tls.key")}
    sc = await start_tap(**{**tls_flags(dev_ca), **flags})
    admin = client(dev_ca, "admin")

    async def served_as() -> str:  # (a new connection: a new handshake)
        host, port = sc.url.removeprefix("https://").rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port), ssl=admin)
        cert = writer.get_extra_info("peercert")
        writer.close()
        return str(dict(x[0] for x in cert["subject"])["commonName"])

    assert await served_as() == "sidecar-d0"
    _install(dev_ca, "daemon", tmp_path)  # (the daemon's certificate names 127.0.0.1 too)
    assert sc.reloader is not None and sc.reloader.reload_if_changed()
    assert await served_as() == "daemon"


@pytest.fixture
async def identity_server(dev_ca: Issued) -> AsyncIterator[tuple[str, list[str | None]]]:
    """A gRPC server over mTLS (the dev CA's daemon certificate) that records each caller's
    certificate CN and answers Nodes/List with no node -> (address, the names seen)."""
    seen: list[str | None] = []

    async def list_nodes(
        request: nodes_pb2.ListNodesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nodes_pb2.ListNodesResponse:
        seen.append(peer_identity_from_grpc(context))
        return nodes_pb2.ListNodesResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        list_nodes,
        request_deserializer=nodes_pb2.ListNodesRequest.FromString,
        response_serializer=nodes_pb2.ListNodesResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("kvferry.v1.Nodes", {"List": handler})]
    )
    files = TlsFiles(dev_ca.out / "ca.pem", dev_ca.out / "daemon.pem", dev_ca.out / "daemon.key")
    port = server.add_secure_port("127.0.0.1:0", grpc_server_credentials(files, require_client_cert=True))
    await server.start()
    yield f"127.0.0.1:{port}", seen
    await server.stop(None)


async def test_the_daemon_link_presents_the_sidecars_certificate_and_follows_rotation(
    identity_server: tuple[str, list[str | None]], dev_ca: Issued, tmp_path: Path
) -> None:
    address, seen = identity_server
    _install(dev_ca, "sidecar-d0", tmp_path)
    link = DaemonLink([address], TlsFiles(dev_ca.out / "ca.pem", tmp_path / "tls.pem", tmp_path / "tls.key"))
    try:
        first = link.channel()
        await link.nodes(first).List(nodes_pb2.ListNodesRequest(), timeout=10)
        assert link.channel() is first and seen == ["sidecar-d0"]
        _install(dev_ca, "router", tmp_path)
        second = link.channel()
        assert second is not first
        await link.nodes(second).List(nodes_pb2.ListNodesRequest(), timeout=10)
        assert seen == ["sidecar-d0", "router"]
    finally:
        await link.close()


def test_development_mode_trusts_every_caller_and_its_tenant_header() -> None:
    caller = caller_of(None, None, "")
    assert caller is Caller.DEVELOPMENT and caller.role is Role.ADMIN
    assert tenant_of(None, caller, {TURN_ID_HEADER: "t", TENANT_HEADER: "acme"}, TENANT_HEADER) == "acme"
    assert tenant_of(None, caller, {"X-Front-Door-Tenant": "b"}, "X-Front-Door-Tenant") == "b"
    s = Settings(tap=TapSettings(listen="0.0.0.0:0"), security=SecuritySettings(insecure=True))
    s.validate()  # (plaintext beyond loopback: said to be meant)


def sidecar_main(argv: list[str]) -> int:
    """`kvferry sidecar ARGV`, in this process (logging left as the tests configured it)."""
    return run_args(build_parser().parse_args(argv))


def test_tls_settings_are_checked_at_start(
    dev_ca: Issued, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--engine-url", "http://127.0.0.1:1", "--daemon", "127.0.0.1:2"]
    assert sidecar_main([*base, "--listen", "0.0.0.0:8100"]) == 2
    assert (
        "--listen 0.0.0.0:8100 is not a loopback address and no TLS is configured" in capsys.readouterr().err
    )
    assert sidecar_main([*base, "--tls-ca", str(dev_ca.out / "ca.pem")]) == 2
    assert "missing --tls-cert, --tls-key" in capsys.readouterr().err
    bad = tmp_path / "policy.toml"
    bad.write_text('[identities.x]\nrole = "king"\n')
    assert sidecar_main([*base, "--policy", str(bad)]) == 2
    assert "identities.x.role must be one of" in capsys.readouterr().err
    missing = ["--tls-ca", str(tmp_path / "none.pem"), "--tls-cert", "c", "--tls-key", "k"]
    assert sidecar_main([*base, *missing]) == 2
    assert f"TLS file {tmp_path / 'none.pem'}" in capsys.readouterr().err


def test_tls_off_loopback_without_a_policy_is_refused(
    dev_ca: Issued, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a policy every caller of the tap is an admin, and its TLS asks for no client
    certificate: off loopback, anyone on the network would reset the engine's cache or name
    any tenant. So that takes --policy, or --insecure to say it is meant."""
    certs = dev_ca.out
    argv = [
        *("--engine-url", "http://127.0.0.1:1", "--daemon", "127.0.0.1:2", "--listen", "0.0.0.0:8100"),
        *("--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "sidecar-d0.pem")),
        *("--tls-key", str(certs / "sidecar-d0.key")),
    ]
    assert sidecar_main(argv) == 2
    err = capsys.readouterr().err
    assert "--listen 0.0.0.0:8100 is not a loopback address and no --policy is given" in err
    from_args(build_parser().parse_args([*argv, "--insecure", "true"])).validate()  # (meant: allowed)
    policy = ["--policy", str(certs / "policy.toml")]
    from_args(build_parser().parse_args([*argv, *policy])).validate()

"""The router in secure mode: HTTPS for clients (API keys, no client certificates), mTLS
to the daemon, sidecars and engines with its certificate as its identity, certificates
rotated under it without a restart, a policy's API keys and tenants; and each refusal
to start (plaintext off loopback, incomplete or unreadable TLS files, a bad policy)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kvferry import logs
from kvferry.security.devca import make_dev_ca
from kvferry.security.policy import PolicyError, digest
from kvferry.security.tls import (
    TlsFiles,
    grpc_server_credentials,
    peer_identity_from_grpc,
    peer_identity_from_transport,
    server_ssl_context,
)
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc
from router import Router
from router.cli import main
from router.settings import Settings
from tests.router.conftest import router_settings
from tests.router.fakes import FakeEngine
from tests.router.helpers import ask

ACME_KEY = "sk-acme-prod"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dev CA with a certificate per part, and a policy naming ACME_KEY's tenant "acme"."""
    out = tmp_path_factory.mktemp("ca")
    make_dev_ca(out, nodes=("d0",))
    with (out / "policy.toml").open("a") as f:
        f.write(f'\n[clients.acme-prod]\nkey_sha256 = "{digest(ACME_KEY)}"\ntenant = "acme"\n')
    return out


def tls_files(ca: Path, name: str) -> TlsFiles:
    files = TlsFiles.from_flags(ca / "ca.pem", ca / f"{name}.pem", ca / f"{name}.key")
    assert files is not None
    return files


@dataclass
class Peers:
    """Who each fake heard from: the Common Names of the client certificates."""

    daemon: list[str | None] = field(default_factory=list)
    engines: list[str | None] = field(default_factory=list)
    heard: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on each call the daemon gets."""


@contextlib.asynccontextmanager
async def https_engine(ca: Path, peers: Peers) -> AsyncIterator[FakeEngine]:
    """A fake engine over HTTPS that requires a client certificate of the CA (as a
    sidecar in secure mode does) and closes every connection (each request: a handshake)."""
    fake = FakeEngine()

    @web.middleware
    async def who(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        peers.engines.append(peer_identity_from_transport(request.transport))
        response: web.StreamResponse = await handler(request)
        response.force_close()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(middlewares=[who])
    app.router.add_post("/v1/chat/completions", fake.generate)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    ctx = server_ssl_context(tls_files(ca, "sidecar-d0"), require_client_cert=True)
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
    fake.url = f"https://localhost:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def tls_daemon(ca: Path, peers: Peers, p: FakeEngine, d: FakeEngine) -> AsyncIterator[str]:
    """A daemon stand-in on gRPC with mTLS: Nodes/List names `p` and `d`. -> its address."""

    class Nodes(nodes_pb2_grpc.NodesServicer):
        async def List(
            self, request: nodes_pb2.ListNodesRequest, context: grpc.aio.ServicerContext[Any, Any]
        ) -> nodes_pb2.ListNodesResponse:
            peers.daemon.append(peer_identity_from_grpc(context))
            peers.heard.set()
            listed = [("p0", nodes_pb2.PREFILL, p.url), ("d0", nodes_pb2.DECODE, d.url)]
            return nodes_pb2.ListNodesResponse(
                nodes=[
                    nodes_pb2.Node(engine_id=i, role=r, model="fake", block_size=16, http_url=u, alive=True)
                    for i, r, u in listed
                ]
            )

    server = grpc.aio.server()
    nodes_pb2_grpc.add_NodesServicer_to_server(Nodes(), server)  # type: ignore[abstract]
    creds = grpc_server_credentials(tls_files(ca, "daemon"), require_client_cert=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        yield f"localhost:{port}"
    finally:
        await server.stop(0)


def secure(ca: Path, live: Path, daemon: str, policy: Path | None = None, **changes: Any) -> Settings:
    """A router on the TLS daemon, its certificate copied to `live` (to be rotated there),
    with the CA's policy (or `policy`)."""
    live.mkdir(exist_ok=True)
    for suffix in ("pem", "key"):
        shutil.copy(ca / f"router.{suffix}", live / f"router.{suffix}")
    return router_settings(
        None,
        daemon__addresses=(daemon,),
        daemon__nodes_refresh_s=0.05,
        reuse__enabled=False,
        security__tls_ca=str(ca / "ca.pem"),
        security__tls_cert=str(live / "router.pem"),
        security__tls_key=str(live / "router.key"),
        security__policy=str(policy or ca / "policy.toml"),
        security__reload_check_s=0.05,
        **changes,
    )


async def served_common_name(url: str, ca: Path) -> str | None:
    """The Common Name of the certificate the server at `url` presents (a new connection)."""
    host, _, port = url.removeprefix("https://").rpartition(":")
    _, writer = await asyncio.open_connection(
        host, int(port), ssl=ssl.create_default_context(cafile=ca / "ca.pem")
    )
    cert = writer.get_extra_info("peercert")
    writer.close()
    return peer_common_name(cert)


def peer_common_name(cert: Any) -> str | None:
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


async def until_the_daemon_hears(peers: Peers, name: str, timeout_s: float = 20.0) -> None:
    """Until the daemon's last call came from `name`, or fail after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not peers.daemon or peers.daemon[-1] != name:
            peers.heard.clear()
            await peers.heard.wait()


BODY = {
    "model": "fake",
    "messages": [{"role": "user", "content": "hi"}],
    "conversation_id": "c",
    "stream": True,
}


async def test_https_for_clients_and_mtls_to_every_peer(ca: Path, tmp_path: Path) -> None:
    """Clients reach the router over HTTPS with an API key of the policy (its tenant goes to
    D's sidecar); the daemon and the engines see the router's certificate; a plaintext
    client gets no answer, an unknown key or none gets 401."""
    peers = Peers()
    async with (
        https_engine(ca, peers) as p,
        https_engine(ca, peers) as d,
        tls_daemon(ca, peers, p, d) as address,
        Router(secure(ca, tmp_path / "live", address)) as router,
    ):
        assert router.url.startswith("https://")
        trusting = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=ca / "ca.pem"))
        async with aiohttp.ClientSession(connector=trusting) as http:
            res = await ask(http, router.url, BODY, {"Authorization": f"Bearer {ACME_KEY}"})
            assert res.status == 200 and res.text == "t0t1t2t3t4"
            for headers in ({}, {"Authorization": "Bearer sk-unknown"}, {"X-Kvferry-Tenant": "acme"}):
                refused = await ask(http, router.url, BODY, headers)
                assert (refused.status, refused.body) == (401, {"error": "Unauthorized"}), headers
            async with http.get(
                f"{router.url}/metrics", headers={"Authorization": f"Bearer {ACME_KEY}"}
            ) as r:
                assert r.status == 401 and "client certificate" in (await r.json())["error"]
        scraper = ssl.create_default_context(cafile=ca / "ca.pem")
        scraper.load_cert_chain(ca / "reader.pem", ca / "reader.key")
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=scraper)) as http,
            http.get(f"{router.url}/metrics") as r,
        ):
            assert r.status == 200 and "kvferry_router" in await r.text()
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientError):
                await ask(plain, router.url.replace("https://", "http://"), BODY)
    assert set(peers.daemon) == {"router"} and set(peers.engines) == {"router"}
    [(_, d_headers, _)] = d.requests
    assert d_headers["x-kvferry-tenant"] == "acme"  # the policy's tenant for that key


async def test_rotated_certificates_are_used_without_a_restart(ca: Path, tmp_path: Path) -> None:
    """New files under the router: its front door serves the new certificate, and the
    daemon and the engines see the new identity, on their next connections."""
    peers = Peers()
    live = tmp_path / "live"
    async with (
        https_engine(ca, peers) as p,
        https_engine(ca, peers) as d,
        tls_daemon(ca, peers, p, d) as address,
        Router(secure(ca, live, address)) as router,
    ):
        key = {"Authorization": f"Bearer {ACME_KEY}"}
        trusting = aiohttp.TCPConnector(
            ssl=ssl.create_default_context(cafile=ca / "ca.pem"), force_close=True
        )
        async with aiohttp.ClientSession(connector=trusting) as http:
            assert (await ask(http, router.url, BODY, key)).status == 200
            assert await served_common_name(router.url, ca) == "router"
            # (a certificate of the same CA for a server and a client: sidecar-d0's)
            for suffix in ("pem", "key"):
                shutil.copy(ca / f"sidecar-d0.{suffix}", live / f"router.{suffix}")
            await until_the_daemon_hears(peers, "sidecar-d0")
            assert await served_common_name(router.url, ca) == "sidecar-d0"
            peers.engines.clear()
            assert (await ask(http, router.url, BODY, key)).status == 200
            assert set(peers.engines) == {"sidecar-d0"}


async def test_a_policy_without_clients_lets_no_client_in(ca: Path, tmp_path: Path) -> None:
    """--policy given: a client needs a key the policy (or --api-key) lists, even when it
    lists none; an --api-key key still works, its tenant named after it."""
    policy = tmp_path / "policy.toml"
    policy.write_text('[identities.router]\nrole = "router"\ntenants = ["*"]\n')
    peers = Peers()
    async with (
        https_engine(ca, peers) as p,
        https_engine(ca, peers) as d,
        tls_daemon(ca, peers, p, d) as address,
    ):
        settings = secure(ca, tmp_path / "live", address, policy, server__api_keys=("sk-dev",))
        async with Router(settings) as router:
            trusting = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=ca / "ca.pem"))
            async with aiohttp.ClientSession(connector=trusting) as http:
                for headers in ({}, {"Authorization": f"Bearer {ACME_KEY}"}):
                    refused = await ask(http, router.url, BODY, headers)
                    assert (refused.status, refused.body) == (401, {"error": "Unauthorized"}), headers
                assert (await ask(http, router.url, BODY, {"Authorization": "Bearer sk-dev"})).status == 200
    [(_, d_headers, _)] = d.requests
    assert d_headers["x-kvferry-tenant"].startswith("key-")


# -- refusals to start ---------------------------------------------------------------------


def test_plaintext_off_loopback_is_refused_unless_insecure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)
    with pytest.raises(
        ValueError, match=re.escape("--listen 0.0.0.0:0 is not a loopback address")
    ) as refused:
        Router(
            router_settings(
                None,
                server__listen="0.0.0.0:0",
                nodes__prefill_urls=("http://p:1",),
                nodes__decode_urls=("http://d:1",),
            )
        )
    assert "--tls-cert" in str(refused.value) and "--insecure" in str(refused.value)
    static = ["--prefill", "http://p:1", "--decode", "http://d:1", "--model", "m"]
    assert main(["--listen", "10.0.0.5:8000", *static]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("kvferry router: --listen 10.0.0.5:8000 is not a loopback address")
        and "--insecure" in err
    )
    # (TLS files given in part: that is what is said, wherever it listens)
    assert main(["--listen", "10.0.0.5:8000", "--tls-cert", "router.pem", *static]) == 2
    assert "missing --tls-ca, --tls-key" in capsys.readouterr().err


async def test_insecure_serves_plaintext_off_loopback_with_a_warning(http: aiohttp.ClientSession) -> None:
    settings = router_settings(
        None,
        server__listen="0.0.0.0:0",
        nodes__prefill_urls=("http://127.0.0.1:1",),
        nodes__decode_urls=("http://127.0.0.1:1",),
        nodes__model="m",
        security__insecure=True,
    )
    with capture_logs() as logged:
        router = Router(settings)
    assert [e["listen"] for e in logged if e["event"] == "router.insecure"] == ["0.0.0.0:0"]
    async with router, http.get(router.url + "/health") as r:
        assert r.status == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-ca", "{ca}/ca.pem"], "missing --tls-cert, --tls-key"),
        (
            ["--tls-ca", "{ca}/ca.pem", "--tls-cert", "{ca}/router.pem", "--tls-key", "{ca}/absent.key"],
            "absent.key",
        ),
        (
            ["--tls-ca", "{ca}/ca.pem", "--tls-cert", "{ca}/policy.toml", "--tls-key", "{ca}/router.key"],
            "do not load",
        ),
        (["--policy", "{ca}/absent.toml"], "absent.toml"),
        (["--policy", "{bad}"], "clients.x.tenant must be a tenant name"),
    ],
)
def test_bad_tls_or_policy_files_are_refused_at_start(
    flags: list[str],
    message: str,
    ca: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[clients.x]\nkey_sha256 = "{digest("k")}"\ntenant = "*"\n')
    given = [f.format(ca=ca, bad=bad) for f in flags]
    assert main(["--listen", "127.0.0.1:0", "--prefill", "http://p:1", "--decode", "http://d:1", *given]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvferry router: ") and message in err, err
    if "--policy" in flags:
        with pytest.raises(PolicyError):
            Router(
                router_settings(
                    None,
                    nodes__prefill_urls=("http://p:1",),
                    nodes__decode_urls=("http://d:1",),
                    security__policy=given[-1],
                )
            )

"""A sidecar in a secure deployment, end to end: a daemon with mTLS and a policy, the
sidecar registering its engine with its own certificate, a router's turn through its
HTTPS tap registering a retention under the router's tenant, and a sidecar whose
certificate names another engine getting nowhere.
"""

from __future__ import annotations

import ssl
from dataclasses import replace
from pathlib import Path

import aiohttp
import grpc
import pytest
from structlog.testing import capture_logs

from controlplane.daemon import Daemon
from controlplane.settings import SecuritySettings
from kvferry.security.devca import make_dev_ca
from kvferry.turnheaders import CONVERSATION_HEADER, TENANT_HEADER, TURN_ID_HEADER
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from tests.conftest import DaemonFactory, daemon_settings
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar
from tests.sidecar.helpers import first_turn, prefill

POLICY = """
[identities.router]
role = "router"
tenants = ["acme"]
[identities.admin]
role = "admin"
[identities.sidecar-d0]
role = "sidecar"
node = "d0"
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_dev_ca(out, nodes=("d0",))
    (out / "policy.toml").write_text(POLICY)
    return out


@pytest.fixture
async def secure_daemon(make_daemon: DaemonFactory, etcd_endpoint: str, certs: Path) -> Daemon:
    security = SecuritySettings(
        tls_ca=certs / "ca.pem",
        tls_cert=certs / "daemon.pem",
        tls_key=certs / "daemon.key",
        policy=certs / "policy.toml",
    )
    return await make_daemon(replace(daemon_settings(etcd_endpoint), security=security))


def _flags(certs: Path, engine_id: str) -> dict[str, object]:
    return {
        "engine__engine_id": engine_id,
        "security__tls_ca": str(certs / "ca.pem"),
        "security__tls_cert": str(certs / "sidecar-d0.pem"),
        "security__tls_key": str(certs / "sidecar-d0.key"),
        "security__policy": str(certs / "policy.toml"),
    }


def _admin(certs: Path, daemon: Daemon) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "admin.key").read_bytes(),
        (certs / "admin.pem").read_bytes(),
    )
    return grpc.aio.secure_channel(daemon.address, creds)


async def test_a_router_turn_through_the_tap_registers_under_the_routers_tenant(
    secure_daemon: Daemon,
    certs: Path,
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    sc = await start_sidecar(d, against=secure_daemon, **_flags(certs, "d0"))
    admin = _admin(certs, secure_daemon)
    try:
        nodes = nodes_pb2_grpc.NodesStub(admin)

        async def registered() -> bool:
            listed = await nodes.List(nodes_pb2.ListNodesRequest(), timeout=5)
            return any(n.engine_id == "d0" and n.alive and n.http_url == sc.url for n in listed.nodes)

        await eventually(registered, within=20)
        assert sc.url.startswith("https://")
        router = ssl.create_default_context(cafile=certs / "ca.pem")
        router.load_cert_chain(certs / "router.pem", certs / "router.key")
        messages = first_turn()
        p1 = await prefill(http, p.http_url, messages)
        headers = {TURN_ID_HEADER: "turn-1", TENANT_HEADER: "acme", CONVERSATION_HEADER: "secure-1"}
        body = {"messages": messages, "max_tokens": 4, "kv_transfer_params": p1.params}
        async with http.post(sc.url + "/v1/chat/completions", json=body, headers=headers, ssl=router) as r:
            assert r.status == 200
        assert sc.retentions is not None and await sc.retentions.wait_idle(10)
        lease = await leases_pb2_grpc.LeasesStub(admin).Get(
            leases_pb2.GetLeaseRequest(tenant="acme", conversation_id="secure-1"), timeout=5
        )
        assert lease.engine_id == "d0" and lease.tenant == "acme"
    finally:
        await admin.close()


async def test_a_sidecar_speaking_for_another_engine_is_denied(
    secure_daemon: Daemon, certs: Path, start_emulator: StartEmulator, start_sidecar: StartSidecar
) -> None:
    d = await start_emulator(role="decode")
    with capture_logs() as logs:
        sc = await start_sidecar(d, against=secure_daemon, **_flags(certs, "d9"))

        async def denied() -> bool:
            return sc.metrics.value("kvferry_sidecar_attaches_total", outcome="denied") > 0

        await eventually(denied, within=20)
    (line,) = [e for e in logs if e["event"] == "node.register.denied"][:1]
    assert line["code"] == "PERMISSION_DENIED" and "'d9'" in line["detail"]

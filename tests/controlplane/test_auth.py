"""Let no one in (issue 21): a daemon with TLS and a policy refuses every attack of the
issue, each with its status, its message and an audit line. Real certificates of the
development CA, a real daemon, real channels; grpcurl for the bearer token."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from controlplane.daemon import Daemon
from controlplane.settings import SecuritySettings
from kvferry.security.devca import make_dev_ca
from kvferry.security.policy import digest
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from tests.cli.test_operator_tools import BIN, run
from tests.conftest import DaemonFactory, daemon_settings
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually

ADMIN_TOKEN = "admin-secret-token"
READER_TOKEN = "grafana-secret-token"
POLICY = f"""
[identities.daemon]
role = "daemon"
[identities.router]
role = "router"
tenants = ["acme"]
[identities.reader]
role = "reader"
tenants = ["acme"]
[identities.admin]
role = "admin"
[identities.sidecar-d0]
role = "sidecar"
node = "d0"
[identities.sidecar-d1]
role = "sidecar"
node = "d1"
[identities.ops]
role = "admin"
token_sha256 = "{digest(ADMIN_TOKEN)}"
[identities.grafana]
role = "reader"
tenants = ["acme"]
token_sha256 = "{digest(READER_TOKEN)}"
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_dev_ca(out, nodes=("d0", "d1", "stranger"))
    (out / "policy.toml").write_text(POLICY)  # ("sidecar-stranger": a certificate the policy lacks)
    make_dev_ca(out / "other")  # another CA: its certificates get nowhere
    return out


class As:
    """Stubs for one daemon, as one identity (its certificate, or a bearer token)."""

    def __init__(self, address: str, certs: Path, name: str | None, token: str = "") -> None:
        ca = (certs / "ca.pem").read_bytes()
        key = (certs / f"{name}.key").read_bytes() if name else None
        chain = (certs / f"{name}.pem").read_bytes() if name else None
        creds = grpc.ssl_channel_credentials(ca, key, chain)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        self.channel = grpc.aio.secure_channel(address, creds)
        self.leases = leases_pb2_grpc.LeasesStub(self.channel)
        self.nodes = nodes_pb2_grpc.NodesStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


Connect = Callable[..., As]


@pytest.fixture
async def secure(make_daemon: DaemonFactory, etcd_endpoint: str, certs: Path) -> Daemon:
    """A daemon as deploy/ starts it: mTLS, the policy, and a TLS port for bearer tokens."""
    security = SecuritySettings(
        tls_ca=certs / "ca.pem",
        tls_cert=certs / "daemon.pem",
        tls_key=certs / "daemon.key",
        policy=certs / "policy.toml",
        token_listen="127.0.0.1:0",
    )
    base = daemon_settings(etcd_endpoint)
    return await make_daemon(replace(base, security=security, server=replace(base.server, metrics_port=0)))


@pytest.fixture
async def as_(secure: Daemon, certs: Path) -> AsyncIterator[Connect]:
    made: list[As] = []

    def connect(name: str | None, token: str = "", certs_dir: Path = certs) -> As:
        port = secure.token_port if name is None else secure.port
        made.append(As(f"127.0.0.1:{port}", certs_dir, name, token))
        return made[-1]

    yield connect
    for c in made:
        await c.channel.close()


async def _refused(call: Any, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


def _denials(logs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["identity"], e["action"], e["code"]) for e in logs if e["event"] == "audit.denied"]


async def _setup(as_: Connect) -> None:
    """d0 and d1 registered by their sidecars; a retention of acme's conversation on d1."""
    d0, d1 = as_("sidecar-d0"), as_("sidecar-d1")
    await d0.nodes.Register(node_request("d0"), timeout=10)
    await d1.nodes.Register(node_request("d1"), timeout=10)
    await d1.leases.Register(lease_request("conv-1", "d1", tenant="acme", seq=list(range(1000))), timeout=10)


async def test_anonymous_callers_get_nothing(as_: Connect, secure: Daemon, certs: Path) -> None:
    anonymous = as_(None)  # TLS, no certificate, no token: the token port lets it talk
    with capture_logs() as logs:
        message = await _refused(
            anonymous.leases.List(leases_pb2.ListLeasesRequest(all_tenants=True), timeout=10),
            grpc.StatusCode.UNAUTHENTICATED,
        )
    assert message == "no identity: present a client certificate or a bearer token of the policy"
    assert _denials(logs) == [("-", "/kvferry.v1.Leases/List", "unauthenticated")]
    # Health is for everyone (probes); a wrong token names what was wrong.
    reply = await anonymous.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    message = await _refused(
        as_(None, token="guess").nodes.List(nodes_pb2.ListNodesRequest(), timeout=10),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    assert message == "no identity: the bearer token is not one of the policy's"
    # The main port asks for a client certificate: without one, or one of another CA, or
    # in plaintext, no call gets through; a certificate the policy does not name is anonymous.
    for stranger in (
        As(secure.address, certs, None),
        As(secure.address, certs / "other", "admin"),
    ):
        await _refused(
            stranger.nodes.List(nodes_pb2.ListNodesRequest(), timeout=10), grpc.StatusCode.UNAVAILABLE
        )
        await stranger.channel.close()
    async with grpc.aio.insecure_channel(secure.address) as plain:
        stub = nodes_pb2_grpc.NodesStub(plain)
        await _refused(stub.List(nodes_pb2.ListNodesRequest(), timeout=10), grpc.StatusCode.UNAVAILABLE)
    message = await _refused(
        as_("sidecar-stranger").nodes.Register(node_request("stranger"), timeout=10),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    assert message == "no identity: certificate CN 'sidecar-stranger' is not an identity of the policy"


async def test_roles_are_held_to_their_methods(as_: Connect) -> None:
    await _setup(as_)
    with capture_logs() as logs:
        message = await _refused(
            as_("router").leases.Revoke(
                leases_pb2.RevokeLeaseRequest(tenant="acme", conversation_id="conv-1"), timeout=10
            ),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    assert message == (
        "identity 'router' (role router) may revoke a retention only as a conversation's end "
        "(conversation_end)"
    )
    assert _denials(logs) == [("router", "/kvferry.v1.Leases/Revoke", "permission_denied")]
    # A conversation's end, yes: of its own tenants only.
    with capture_logs() as logs:
        message = await _refused(
            as_("router").leases.Revoke(
                leases_pb2.RevokeLeaseRequest(
                    tenant="other", conversation_id="conv-1", conversation_end=True
                ),
                timeout=10,
            ),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    assert message == "identity 'router' (role router) may not act for tenant 'other'"
    assert _denials(logs) == [("router", "/kvferry.v1.Leases/Revoke", "permission_denied")]
    reader = as_("reader")
    await _refused(
        reader.leases.Lookup(lookup_request("conv-1", tenant="acme"), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await _refused(
        reader.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id="d0"), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    listed = await reader.leases.List(leases_pb2.ListLeasesRequest(tenant="acme"), timeout=10)
    assert [x.conversation_id for x in listed.leases] == ["conv-1"]
    # An admin may, and leaves an audit line of what it did.
    with capture_logs() as logs:
        revoked = await as_("admin").leases.Revoke(
            leases_pb2.RevokeLeaseRequest(tenant="acme", conversation_id="conv-1"), timeout=10
        )
    assert revoked.found
    assert [(e["identity"], e["action"]) for e in logs if e["event"] == "audit.allowed"] == [
        ("admin", "/kvferry.v1.Leases/Revoke")
    ]


async def test_only_routers_learn_where_lookups_are_decided(as_: Connect) -> None:
    routes = await as_("router").leases.Routes(leases_pb2.RoutesRequest(), timeout=10)
    assert routes.shards == 32
    assert [list(o.shards) for o in routes.owners] == [list(range(32))]  # (this replica's alone)
    for who in ("reader", "sidecar-d0"):
        message = await _refused(
            as_(who).leases.Routes(leases_pb2.RoutesRequest(), timeout=10), grpc.StatusCode.PERMISSION_DENIED
        )
        assert message.endswith("may not call /kvferry.v1.Leases/Routes: it needs role router or admin")


async def test_rogue_engines_cannot_register(as_: Connect) -> None:
    """Issue 21's first attack: a node registered by someone other than its sidecar."""
    for name in ("router", "reader", "daemon"):
        message = await _refused(
            as_(name).nodes.Register(node_request("rogue", http_url="http://10.9.9.9:8000"), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        assert "may not call /kvferry.v1.Nodes/Register: it needs role sidecar or admin" in message
    d0 = as_("sidecar-d0")
    message = await _refused(
        d0.nodes.Register(node_request("d1"), timeout=10), grpc.StatusCode.PERMISSION_DENIED
    )
    assert message == "identity 'sidecar-d0' (role sidecar) may speak only for node 'd0', not 'd1'"
    await d0.nodes.Register(node_request("d0"), timeout=10)  # (its own: fine)
    # Nor may it heartbeat another node on an Attach stream.
    call = d0.nodes.Attach()
    await call.write(nodes_pb2.AttachRequest(hello=nodes_pb2.AttachHello(engine_id="d1")))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        info.value.details() == "identity 'sidecar-d0' (role sidecar) may speak only for node 'd0', not 'd1'"
    )


async def test_kv_poisoning_by_a_forged_retention_fails(as_: Connect) -> None:
    """Issue 21's second attack: another engine's sidecar registers a retention for a
    victim's conversation with the victim's digests and its own D blocks."""
    await _setup(as_)
    victim = await as_("admin").leases.Get(
        leases_pb2.GetLeaseRequest(tenant="acme", conversation_id="conv-1")
    )
    forged = lease_request("conv-1", "d0", tenant="acme")
    forged.block_digests = victim.block_digests
    d0 = as_("sidecar-d0")
    # engine_id d1 (the victim's D): only d1's sidecar speaks for it.
    forged_on_d1 = lease_request("conv-1", "d1", tenant="acme", params={**dict(victim.kv_transfer_params)})
    with capture_logs() as logs:
        message = await _refused(
            d0.leases.Register(forged_on_d1, timeout=10), grpc.StatusCode.PERMISSION_DENIED
        )
    assert message == "identity 'sidecar-d0' (role sidecar) may speak only for node 'd0', not 'd1'"
    assert _denials(logs) == [("sidecar-d0", "/kvferry.v1.Leases/Register", "permission_denied")]
    # The same on a Leases/Stream: that op is refused, the stream goes on.
    call = d0.leases.Stream()
    await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=1, register=forged_on_d1)]))
    refused = (await call.read()).results[0]
    assert refused.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "may speak only for node 'd0', not 'd1'" in refused.error.message
    own = lease_request("conv-d0", "d0", tenant="acme")
    await call.write(leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=2, register=own)]))
    assert (await call.read()).results[0].WhichOneof("result") == "register"
    # A sidecar looks nothing up either (the digests and D addresses are the routers').
    await call.write(
        leases_pb2.LeaseOpBatch(
            ops=[leases_pb2.LeaseOp(id=3, lookup=lookup_request("conv-1", tenant="acme"))]
        )
    )
    looked = (await call.read()).results[0]
    assert looked.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert looked.error.message == (
        "identity 'sidecar-d0' (role sidecar) may not send lookup operations on Leases/Stream"
    )
    await call.done_writing()
    # The victim's retention is as it was.
    after = await as_("admin").leases.Get(leases_pb2.GetLeaseRequest(tenant="acme", conversation_id="conv-1"))
    assert after.engine_id == "d1" and after.block_digests == victim.block_digests


async def test_tenants_see_only_their_own(as_: Connect) -> None:
    """Issue 21's third attack: another tenant's retentions read, claimed or listed."""
    await _setup(as_)
    router = as_("router")  # acme's
    globex = lookup_request("conv-1", tenant="globex")
    message = await _refused(router.leases.Lookup(globex, timeout=10), grpc.StatusCode.PERMISSION_DENIED)
    assert message == "identity 'router' (role router) may not act for tenant 'globex'"
    await _refused(
        router.leases.Get(leases_pb2.GetLeaseRequest(tenant="globex", conversation_id="c"), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await _refused(  # (no tenant: the default one, not acme's)
        router.leases.List(leases_pb2.ListLeasesRequest(), timeout=10), grpc.StatusCode.PERMISSION_DENIED
    )
    message = await _refused(
        router.leases.List(leases_pb2.ListLeasesRequest(all_tenants=True), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert message == "identity 'router' (role router) may not list all tenants: it needs role admin"
    everyone = await as_("admin").leases.List(leases_pb2.ListLeasesRequest(all_tenants=True), timeout=10)
    assert [x.conversation_id for x in everyone.leases] == ["conv-1"]
    # On a stream: the other tenant's lookup is refused, its own goes through.
    call = router.leases.Stream()
    await call.write(
        leases_pb2.LeaseOpBatch(
            ops=[
                leases_pb2.LeaseOp(id=1, lookup=globex),
                leases_pb2.LeaseOp(id=2, lookup=lookup_request("conv-1", tenant="acme", prompt_tokens=1200)),
            ]
        )
    )
    results: dict[int, Any] = {}
    while len(results) < 2:
        for r in (await call.read()).results:
            results[r.id] = r
    await call.done_writing()
    assert results[1].error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert results[2].lookup.decision == leases_pb2.PULL


async def test_a_bearer_token_through_grpcurl(secure: Daemon, certs: Path, as_: Connect) -> None:
    """People use grpcurl with a token of the policy, on the token port."""
    await _setup(as_)
    address = f"127.0.0.1:{secure.token_port}"
    base = [str(BIN / "grpcurl"), "-cacert", str(certs / "ca.pem")]
    code, out, err = await run(
        *base,
        "-H",
        f"authorization: Bearer {ADMIN_TOKEN}",
        "-d",
        '{"all_tenants": true}',
        address,
        "kvferry.v1.Leases/List",
    )
    assert code == 0, err
    assert '"conv-1"' in out
    code, out, err = await run(
        *base,
        "-H",
        f"authorization: Bearer {READER_TOKEN}",
        "-d",
        '{"all_tenants": true}',
        address,
        "kvferry.v1.Leases/List",
    )
    assert code != 0 and "PermissionDenied" in err
    assert "identity 'grafana' (role reader) may not list all tenants" in err
    code, out, err = await run(*base, "-d", "{}", address, "kvferry.v1.Nodes/List")
    assert code != 0 and "Unauthenticated" in err and "no identity" in err


async def test_metrics_need_a_client_certificate(secure: Daemon, certs: Path) -> None:
    url = f"https://127.0.0.1:{secure.metrics_port}/metrics"
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    anonymous = ctx
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        await asyncio.to_thread(lambda: urllib.request.urlopen(url, context=anonymous, timeout=10).read())
    scraper = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    scraper.load_cert_chain(certs / "reader.pem", certs / "reader.key")
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, context=scraper, timeout=10).read())
    assert b"kvferry_" in body


async def test_replicas_ask_each_other_with_the_daemons_certificate(
    secure: Daemon, make_daemon: DaemonFactory, certs: Path
) -> None:
    """Nodes/List on one replica counts the sidecars attached to the other: the replicas
    call each other as the policy's `daemon` identity, over mTLS."""
    other = await make_daemon(secure.settings)  # (same etcd prefix: a second replica)
    d0 = As(secure.address, certs, "sidecar-d0")
    router = As(other.address, certs, "router")
    queue: asyncio.Queue[nodes_pb2.AttachRequest] = asyncio.Queue()

    async def requests() -> AsyncIterator[nodes_pb2.AttachRequest]:
        while True:
            yield await queue.get()

    call = d0.nodes.Attach(requests())
    try:
        reply = await d0.nodes.Register(node_request("d0"), timeout=10)
        hello = nodes_pb2.AttachHello(engine_id="d0", generation=reply.node.generation)
        queue.put_nowait(nodes_pb2.AttachRequest(hello=hello))
        queue.put_nowait(nodes_pb2.AttachRequest(heartbeat=nodes_pb2.Heartbeat(seq=1, uncaptured_turns=7)))
        await call.read()
        await call.read()  # (the heartbeat's ack: the count is in)

        async def counted() -> bool:
            listed = await router.nodes.List(nodes_pb2.ListNodesRequest(), timeout=10)
            return [n.uncaptured_turns for n in listed.nodes] == [7]

        with capture_logs() as logs:
            await eventually(counted, within=20)
        assert _denials(logs) == []
    finally:
        call.cancel()
        await d0.channel.close()
        await router.channel.close()

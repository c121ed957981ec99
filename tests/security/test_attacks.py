"""Every attack of issue 21, against the deployment deploy/compose describes (its
certificates from `kvferry certs`, its policy, its flags), run as processes on loopback.

The attacker is on the same network: it can reach every port, it holds no certificate of
the deployment's CA (or, where said, the certificate of another part), and it knows the
API's shape. Each attack must fail with a status and a message that say why, and the
deployment must go on serving its real clients, reuse included.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvferry.security.devca import make_dev_ca
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from tests.cli.test_operator_tools import BIN
from tests.security.deployment import Deployment, compose_deployment, wait_for

API_KEY = "compose-demo-key"  # (the compose file's demo client key)
MODEL = "Qwen/Qwen3-32B"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with compose_deployment(tmp_path_factory.mktemp("compose")) as d:
        wait_for("two nodes registered", lambda: len(nodes(d, "admin").nodes) == 2, d)
        wait_for("the router", lambda: _get(d, "/health").status == 200, d)
        yield d


def channel(d: Deployment, identity: str | None) -> grpc.Channel:
    """A channel to the daemon as `identity` (None: TLS with no client certificate)."""
    ca = (d.certs / "ca.pem").read_bytes()
    if identity is None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
    else:
        key, cert = (d.certs / f"{identity}.key").read_bytes(), (d.certs / f"{identity}.pem").read_bytes()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(d.address("daemon", 50051), creds)


def nodes(d: Deployment, identity: str) -> nodes_pb2.ListNodesResponse:
    with channel(d, identity) as ch:
        return nodes_pb2_grpc.NodesStub(ch).List(nodes_pb2.ListNodesRequest(), timeout=10)


def refused(call: Any, code: grpc.StatusCode, says: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value
    assert says in (e.value.details() or ""), e.value.details()


def ssl_context(d: Deployment, identity: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=d.certs / "ca.pem")
    if identity is not None:
        ctx.load_cert_chain(d.certs / f"{identity}.pem", d.certs / f"{identity}.key")
    return ctx


class Answer:
    def __init__(self, status: int, body: bytes, headers: Any) -> None:
        self.status, self.body, self.headers = status, body, headers

    def json(self) -> Any:
        return json.loads(self.body)


def _http(
    url: str,
    ctx: ssl.SSLContext,
    method: str = "GET",
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=60) as r:
            return Answer(r.status, r.read(), r.headers)
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read(), e.headers)


def _get(d: Deployment, path: str) -> Answer:
    return _http(f"https://{d.address('router', 8000)}{path}", ssl_context(d, None))


def turn(
    d: Deployment, conversation: str, messages: list[dict[str, str]], key: str = API_KEY, **headers: str
) -> Answer:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return _http(
        f"https://{d.address('router', 8000)}/v1/chat/completions",
        ssl_context(d, None),
        "POST",
        {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
        {"X-Conversation-Id": conversation, **auth, **headers},
    )


def conversation(d: Deployment, cid: str) -> tuple[Answer, Answer]:
    """Two turns of one conversation through the router: the second may pull the first's KV."""
    history = [{"role": "user", "content": "tell me about the sea " * 60}]
    first = turn(d, cid, history)
    assert first.status == 200, first.body
    retained(d, cid)
    history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    history += [{"role": "user", "content": "and the mountains?"}]
    return first, turn(d, cid, history)


def retained(d: Deployment, cid: str) -> None:
    """Wait until the daemon holds a retention of conversation `cid` (D's sidecar registers
    it after the answer, on its own time: a second turn sent at once may find none)."""
    with channel(d, "admin") as ch:
        leases = leases_pb2_grpc.LeasesStub(ch)

        def held() -> bool:
            listed = leases.List(leases_pb2.ListLeasesRequest(all_tenants=True), timeout=10)
            return any(r.conversation_id == cid for r in listed.leases)

        wait_for(f"a retention of {cid!r}", held, d, timeout_s=30)


def test_real_clients_are_served_with_reuse(deployment: Deployment) -> None:
    _, second = conversation(deployment, "served")
    assert second.status == 200 and int(second.headers["X-Kvferry-Reused-Tokens"]) > 0


def test_no_plaintext_and_no_stranger_gets_a_connection(deployment: Deployment, tmp_path: Path) -> None:
    with grpc.insecure_channel(deployment.address("daemon", 50051)) as ch:
        refused(
            lambda: nodes_pb2_grpc.NodesStub(ch).List(nodes_pb2.ListNodesRequest(), timeout=10),
            grpc.StatusCode.UNAVAILABLE,
            "",
        )
    with channel(deployment, None) as ch:  # TLS, but no client certificate: no handshake
        refused(
            lambda: nodes_pb2_grpc.NodesStub(ch).List(nodes_pb2.ListNodesRequest(), timeout=10),
            grpc.StatusCode.UNAVAILABLE,
            "",
        )
    other = tmp_path / "other-ca"
    make_dev_ca(other)  # (an attacker's own CA, with an "admin" of its own)
    shutil.copy(deployment.certs / "ca.pem", other / "their-ca.pem")
    creds = grpc.ssl_channel_credentials(
        (other / "their-ca.pem").read_bytes(),
        (other / "admin.key").read_bytes(),
        (other / "admin.pem").read_bytes(),
    )
    with grpc.secure_channel(deployment.address("daemon", 50051), creds) as ch:
        refused(
            lambda: nodes_pb2_grpc.NodesStub(ch).List(nodes_pb2.ListNodesRequest(), timeout=10),
            grpc.StatusCode.UNAVAILABLE,
            "",
        )
    for service, port in (("router", 8000), ("decode-sidecar", 8100), ("prefill-sidecar", 8100)):
        with socket.create_connection(("127.0.0.1", deployment.port(service, port)), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # (plaintext to a TLS port)
            assert not s.recv(1024).startswith(b"HTTP/1.1 200")


def test_rogue_engines_cannot_register(deployment: Deployment) -> None:
    rogue = nodes_pb2.RegisterNodeRequest(
        engine_id="rogue",
        role=nodes_pb2.PREFILL,
        model=MODEL,
        block_size=16,
        http_url="https://10.9.9.9:8100",
    )
    for identity, code, says in (
        ("router", grpc.StatusCode.PERMISSION_DENIED, "may not call /kvferry.v1.Nodes/Register"),
        ("reader", grpc.StatusCode.PERMISSION_DENIED, "may not call /kvferry.v1.Nodes/Register"),
        ("sidecar-decode-0", grpc.StatusCode.PERMISSION_DENIED, "only for node 'decode-0', not 'rogue'"),
    ):
        with channel(deployment, identity) as ch:
            refused(lambda: nodes_pb2_grpc.NodesStub(ch).Register(rogue, timeout=10), code, says)
    # A sidecar's own certificate cannot point its engine at the metadata service either.
    listed = {n.engine_id: n for n in nodes(deployment, "admin").nodes}
    hijack = nodes_pb2.RegisterNodeRequest(
        engine_id="decode-0", role=nodes_pb2.DECODE, model=MODEL, block_size=16, http_url="http://169.254.169.254/",
        side_channel_host="localhost", side_channel_port=5600,
    )  # fmt: skip
    with channel(deployment, "sidecar-decode-0") as ch:
        refused(
            lambda: nodes_pb2_grpc.NodesStub(ch).Register(hijack, timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "http_url",
        )
    after = {n.engine_id: n for n in nodes(deployment, "admin").nodes}
    assert set(after) == {"prefill-0", "decode-0"}
    assert {k: n.http_url for k, n in after.items()} == {k: n.http_url for k, n in listed.items()}


def test_kv_poisoning_by_a_forged_retention_fails(deployment: Deployment) -> None:
    first, _ = conversation(deployment, "victim")
    # Its digests are not handed out to the other parts (the dev policy's router acts for
    # every tenant, so only sidecars are left to try; tests/controlplane/test_auth.py has a
    # router bound to one tenant).
    with channel(deployment, "sidecar-prefill-0") as ch:
        refused(
            lambda: leases_pb2_grpc.LeasesStub(ch).List(
                leases_pb2.ListLeasesRequest(all_tenants=True), timeout=10
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "may not call /kvferry.v1.Leases/List",
        )
    with channel(deployment, "admin") as ch:
        held = leases_pb2_grpc.LeasesStub(ch).List(leases_pb2.ListLeasesRequest(all_tenants=True), timeout=10)
    victim = next(r for r in held.leases if r.conversation_id == "victim")
    forged = leases_pb2.RegisterLeaseRequest(
        tenant=victim.tenant, conversation_id="victim", engine_id="decode-0", num_tokens=victim.num_tokens,
        block_size=victim.block_size, block_digests=victim.block_digests, generation=victim.generation,
    )  # fmt: skip
    forged.kv_transfer_params.update({"remote_block_ids": [1, 2, 3], "remote_host": "10.6.6.6"})
    for identity, code, says in (
        (None, grpc.StatusCode.UNAVAILABLE, ""),  # (no certificate: no connection at all)
        ("prefill-sidecar", grpc.StatusCode.PERMISSION_DENIED, "only for node 'prefill-0', not 'decode-0'"),
        ("router", grpc.StatusCode.PERMISSION_DENIED, "may not call /kvferry.v1.Leases/Register"),
    ):
        name = {"prefill-sidecar": "sidecar-prefill-0"}.get(identity or "", identity)
        with channel(deployment, name) as ch:
            refused(lambda: leases_pb2_grpc.LeasesStub(ch).Register(forged, timeout=10), code, says)
    history = [{"role": "user", "content": "tell me about the sea " * 60}]
    history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    history += [{"role": "user", "content": "and the mountains?"}]
    # (the conversation's second turn was pulled already: a third one pulls the second's KV)
    again = turn(
        deployment,
        "victim",
        [*history, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
    )
    assert again.status == 200 and int(again.headers["X-Kvferry-Reused-Tokens"]) > 0


def test_no_tenant_is_read_claimed_or_revoked_by_another(deployment: Deployment) -> None:
    conversation(deployment, "private")
    with channel(deployment, "sidecar-decode-0") as ch:  # a part of the deployment, not a router
        leases = leases_pb2_grpc.LeasesStub(ch)
        refused(
            lambda: leases.Lookup(
                leases_pb2.LookupRequest(conversation_id="private", prompt_tokens=100), timeout=10
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "Leases/Lookup",
        )
        refused(
            lambda: leases.List(leases_pb2.ListLeasesRequest(), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "Leases/List",
        )
        refused(
            lambda: leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="private"), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "Leases/Revoke",
        )
    with channel(deployment, "router") as ch:
        refused(
            lambda: leases_pb2_grpc.LeasesStub(ch).Revoke(
                leases_pb2.RevokeLeaseRequest(conversation_id="private"), timeout=10
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "may revoke a retention only as a conversation's end",
        )
    # (the router's own tenant is the one its API key names; tenants=["*"] in the dev policy
    # lets the router act for all: tests/controlplane/test_auth.py binds one to a tenant)


def test_the_router_takes_the_tenant_from_the_key_alone(deployment: Deployment) -> None:
    no_key = turn(deployment, "t1", [{"role": "user", "content": "hi"}], key="")
    assert no_key.status == 401 and "error" in no_key.json()
    wrong = turn(deployment, "t1", [{"role": "user", "content": "hi"}], key="guessed-key")
    assert wrong.status == 401 and "error" in wrong.json()
    _, second = conversation(deployment, "named")
    assert int(second.headers["X-Kvferry-Reused-Tokens"]) > 0
    forged = turn(
        deployment, "named", [{"role": "user", "content": "hi"}], **{"X-Kvferry-Tenant": "someone-else"}
    )
    assert forged.status == 200  # (served in its own key's tenant: the header never reached anything)


def test_the_sidecars_port_serves_only_whom_it_should(deployment: Deployment) -> None:
    base = f"https://{deployment.address('decode-sidecar', 8100)}"
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    anonymous = _http(f"{base}/v1/completions", ssl_context(deployment, None), "POST", completion)
    assert anonymous.status == 401 and "error" in anonymous.json()
    as_router = ssl_context(deployment, "router")
    reset = _http(f"{base}/reset_prefix_cache", as_router, "POST")
    assert reset.status == 403 and "needs role admin" in reset.json()["error"]["message"]
    assert _http(f"{base}/reset_prefix_cache", ssl_context(deployment, "admin"), "POST").status == 200
    assert _http(f"{base}/no/such/path", as_router).status == 404
    forged = _http(
        f"{base}/v1/completions",
        ssl_context(deployment, "reader"),
        "POST",
        completion,
        {"X-Kvferry-Tenant": "acme"},
    )
    assert forged.status == 403
    big = _http(f"{base}/v1/completions", as_router, "POST", {"prompt": "x" * (80 << 20)})
    assert big.status == 413 and "error" in big.json()
    port = deployment.port("decode-sidecar", 8100)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        as_router.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(
            b"POST http://evil.example/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        )
        assert tls.recv(1024).startswith(b"HTTP/1.1 400")


def test_metrics_and_reflection_need_an_identity(deployment: Deployment) -> None:
    metrics = f"https://localhost:{deployment.port('daemon', 9464)}/metrics"
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(metrics, context=ssl_context(deployment, None), timeout=10).read()
    with urllib.request.urlopen(metrics, context=ssl_context(deployment, "reader"), timeout=10) as r:
        assert b"kvferry_" in r.read()
    router = f"https://{deployment.address('router', 8000)}/metrics"
    keyed = _http(router, ssl_context(deployment, None), headers={"Authorization": f"Bearer {API_KEY}"})
    assert keyed.status == 401 and "client certificate" in keyed.json()["error"]
    assert _http(router, ssl_context(deployment, "reader")).status == 200
    certs = deployment.certs
    grpcurl = [str(BIN / "grpcurl"), "-cacert", str(certs / "ca.pem")]
    addr = deployment.address("daemon", 50051)
    reader = ["-cert", str(certs / "reader.pem"), "-key", str(certs / "reader.key")]
    listed = subprocess.run([*grpcurl, *reader, addr, "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "kvferry.v1.Leases" in listed.stdout, listed.stderr
    stranger = subprocess.run([*grpcurl, addr, "list"], capture_output=True, text=True, timeout=60)
    assert stranger.returncode != 0

"""The Owners RPC (operations forwarded to a claim shard's owner) is the replicas' own:
only the policy's `daemon` role (and admin) may call it; a router or a sidecar that could
would claim or put retentions with no check of its tenants or node. Replicas forward to
each other over mTLS as `daemon`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from structlog.testing import capture_logs

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2, owners_pb2, owners_pb2_grpc
from tests.conftest import DaemonFactory
from tests.controlplane import test_auth
from tests.controlplane.test_auth import As, Connect, _denials, _refused, _setup
from tests.factories import lease_request, lookup_request, node_request

certs, secure, as_ = test_auth.certs, test_auth.secure, test_auth.as_  # (its fixtures, used here)

READ = owners_pb2.OwnerOp(kind=owners_pb2.OwnerOp.READ, tenant="acme", conversation_id="conv-1")


def _owners(who: As) -> owners_pb2_grpc.OwnersStub:
    return owners_pb2_grpc.OwnersStub(who.channel)


async def test_only_daemons_may_call_the_owners_rpc(as_: Connect) -> None:
    await _setup(as_)
    for name, role in (("router", "router"), ("sidecar-d1", "sidecar"), ("reader", "reader")):
        with capture_logs() as logs:
            message = await _refused(
                _owners(as_(name)).Apply(READ, timeout=10), grpc.StatusCode.PERMISSION_DENIED
            )
        assert message == (
            f"identity '{name}' (role {role}) may not call /kvferry.v1.Owners/Apply: "
            "it needs role daemon or admin"
        )
        assert _denials(logs) == [(name, "/kvferry.v1.Owners/Apply", "permission_denied")]
    answer = await _owners(as_("daemon")).Apply(READ, timeout=10)  # (the lone replica owns it)
    assert answer.retention  # conv-1's retention, as its owner holds it


async def test_a_malformed_forwarded_op_is_refused_with_what_was_wrong(as_: Connect) -> None:
    daemon = _owners(as_("daemon"))
    put = owners_pb2.OwnerOp(kind=owners_pb2.OwnerOp.PUT, tenant="acme", conversation_id="c")
    message = await _refused(daemon.Apply(put, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert message == "owner op PUT: retention is required"
    bad = owners_pb2.OwnerOp(kind=owners_pb2.OwnerOp.PUT, tenant="acme", conversation_id="c", retention=b"{")
    message = await _refused(daemon.Apply(bad, timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
    assert message.startswith("owner op: ")


async def test_replicas_forward_to_each_other_as_daemon_over_mtls(
    secure: Daemon, make_daemon: DaemonFactory, certs: Path
) -> None:
    other = await make_daemon(secure.settings)  # (same etcd prefix: a second replica)
    d1 = As(secure.address, certs, "sidecar-d1")
    routers = [As(secure.address, certs, "router"), As(other.address, certs, "router")]
    try:
        await d1.nodes.Register(node_request("d1"), timeout=10)
        names = [f"fwd-{i}" for i in range(16)]
        for name in names:
            await d1.leases.Register(lease_request(name, "d1", tenant="acme"), timeout=10)
        with capture_logs() as logs:
            answers = await asyncio.gather(
                *(
                    r.leases.Lookup(lookup_request(name, tenant="acme"), timeout=10)
                    for name in names
                    for r in routers
                )
            )
        claimed = [a.claimed for a in answers]
        assert [sum(claimed[i : i + 2]) for i in range(0, len(claimed), 2)] == [1] * len(names)
        assert all(a.reason in ("pull", "already_claimed") for a in answers), answers
        assert _denials(logs) == []
        assert sum(a.decision == leases_pb2.PULL for a in answers) == len(names)
    finally:
        for c in (d1, *routers):
            await c.channel.close()


async def test_only_daemons_may_offer_releases(as_: Connect) -> None:
    """A caller that could would have any node free any blocks."""
    await _setup(as_)
    offer = owners_pb2.NodeReleases(engine_id="d1", releases=[owners_pb2.ForwardedRelease(reason="budget")])
    for name, role in (("router", "router"), ("sidecar-d1", "sidecar")):
        message = await _refused(
            _owners(as_(name)).Release(offer, timeout=10), grpc.StatusCode.PERMISSION_DENIED
        )
        assert message.startswith(f"identity '{name}' (role {role}) may not call /kvferry.v1.Owners/Release")
    answer = await _owners(as_("daemon")).Release(offer, timeout=10)
    assert not answer.taken  # (d1's sidecar is not attached here)
    bad = owners_pb2.NodeReleases(engine_id="d1", releases=[owners_pb2.ForwardedRelease(reason="whim")])
    message = await _refused(
        _owners(as_("daemon")).Release(bad, timeout=10), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "unknown reason 'whim'" in message

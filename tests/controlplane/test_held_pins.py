"""Leases/Held on a real daemon and etcd: a sidecar asks what became of the D requests it
holds pinned. A retained one and a fresh claim's are kept; one claimed over the grace
ago by a turn that never registered since is an orphan; one whose claiming turn went on
is settled. Only the node's own sidecar may ask."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from controlplane.daemon import Daemon
from controlplane.records import Claim, Retention
from controlplane.service.held import HELD_GRACE_S, MAX_HELD_PINS, Pin, pin_state
from kvferry.v1 import leases_pb2
from tests.conftest import Client
from tests.controlplane.test_auth import Connect, _refused, as_, certs, secure  # noqa: F401
from tests.factories import d_params, lease_request, node_request

RETAINED, CLAIMED, SETTLED, ORPHAN = (
    leases_pb2.PIN_RETAINED,
    leases_pb2.PIN_CLAIMED,
    leases_pb2.PIN_SETTLED,
    leases_pb2.PIN_ORPHAN,
)


def _turn(
    conversation: str, turn: str, engine: str = "d-1", tenant: str = ""
) -> leases_pb2.RegisterLeaseRequest:
    """The retention turn `turn` registers; D's request id is the turn's."""
    req = lease_request(
        conversation, engine, num_tokens=160, tenant=tenant, params=d_params(engine, 160, turn)
    )
    req.request_id = turn
    return req


def _held(engine: str, *pins: tuple[str, str], tenant: str = "") -> leases_pb2.HeldRequest:
    return leases_pb2.HeldRequest(
        engine_id=engine,
        pins=[
            leases_pb2.HeldPin(tenant=tenant, conversation_id=c, request_id=t, remote_request_id=t)
            for c, t in pins
        ],
    )


async def test_what_became_of_each_pin(daemon: Daemon, client: Client) -> None:
    assert daemon.control_plane is not None
    store = daemon.control_plane.owned
    await client.nodes.Register(node_request("d-1"), timeout=10)
    for c in ("kept", "fresh", "lost", "went-on"):
        await client.leases.Register(_turn(c, f"{c}-1"), timeout=10)
    # A lookup of turn 2 claims "fresh" now; the others' claims are over the grace old
    # (a claim's marker says when: claimed as if then).
    fresh = leases_pb2.LookupRequest(conversation_id="fresh", prompt_tokens=1200, request_id="fresh-2")
    assert (await client.leases.Lookup(fresh, timeout=10)).claimed
    then = time.time() - HELD_GRACE_S - 5
    for c in ("lost", "went-on"):
        assert (await store.claim("default", c, then, f"{c}-2")).taken is not None
    await client.leases.Register(_turn("went-on", "went-on-2"), timeout=10)  # its turn 2 went on

    pins = [("kept", "kept-1"), ("fresh", "fresh-1"), ("lost", "lost-1"), ("went-on", "went-on-1")]
    answer = await client.leases.Held(_held("d-1", *pins), timeout=10)
    assert list(answer.states) == [RETAINED, CLAIMED, ORPHAN, SETTLED]
    # Turn 2's own retention is retained; a pin of a conversation never seen is settled.
    answer = await client.leases.Held(_held("d-1", ("went-on", "went-on-2"), ("nobody", "x-1")), timeout=10)
    assert list(answer.states) == [RETAINED, SETTLED]


async def test_bad_pins_are_refused_naming_what_was_wrong(daemon: Daemon, client: Client) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.leases.Held(_held("d-1", ("c", "")), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "pins[0]: request_id is required"
    many = _held("d-1", *[("c", f"t-{i}") for i in range(MAX_HELD_PINS + 1)])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.leases.Held(many, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == f"{MAX_HELD_PINS + 1} pins: at most {MAX_HELD_PINS} per Leases/Held call"


async def test_only_the_nodes_own_sidecar_may_ask(as_: Connect, certs: Path) -> None:  # noqa: F811
    d0, d1 = as_("sidecar-d0"), as_("sidecar-d1")
    await d1.nodes.Register(node_request("d1"), timeout=10)
    await d1.leases.Register(_turn("conv-1", "t-1", "d1", tenant="acme"), timeout=10)
    message = await _refused(
        d0.leases.Held(_held("d1", ("conv-1", "t-1"), tenant="acme"), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert message == "identity 'sidecar-d0' (role sidecar) may speak only for node 'd0', not 'd1'"
    message = await _refused(
        as_("router").leases.Held(_held("d1", ("conv-1", "t-1"), tenant="acme"), timeout=10),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert "may not call /kvferry.v1.Leases/Held: it needs role sidecar or admin" in message
    answer = await d1.leases.Held(_held("d1", ("conv-1", "t-1"), tenant="acme"), timeout=10)
    assert list(answer.states) == [RETAINED]


def _retention(turn: str) -> Retention:
    return Retention(
        engine_id="d-1",
        generation=1,
        params=b"",
        num_tokens=160,
        block_size=16,
        created_at=0.0,
        expires_at=1e12,
        digests=b"",
        request_id=turn,
    )


NOW = 10_000.0
OLD = Claim(claimed_at=NOW - HELD_GRACE_S - 1, claimed_by="t-2")


@pytest.mark.parametrize(
    ("current", "marker", "state"),
    [
        ("t-1", OLD, RETAINED),  # still retained (a put-back brought it back, say)
        (None, Claim(claimed_at=NOW - 1, claimed_by="t-2"), CLAIMED),  # a pull may be under way
        (None, None, SETTLED),  # replaced, revoked or released: their callers free it
        (None, Claim(claimed_at=NOW - 999, claimed_by="t-1"), SETTLED),  # its own turn's claim: never claimed
        (None, Claim(claimed_at=NOW - 999, claimed_by=""), SETTLED),  # who claimed it: not known
        ("t-2", OLD, SETTLED),  # the claiming turn registered since: it went on
        (None, OLD, ORPHAN),  # claimed long ago, its turn never registered
        ("t-2-retry", OLD, ORPHAN),  # ... and the client's retry registered instead
    ],
)
def test_pin_state(current: str | None, marker: Claim | None, state: int) -> None:
    pin = Pin("default", "c", "t-1", "d-req-1")
    got = pin_state(pin, None if current is None else _retention(current), marker, NOW)
    assert getattr(leases_pb2, f"PIN_{got.name}") == state

"""What the recorder makes of each answer: which retention it hands out or takes, and
which failures prove nothing was done."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvferry.leaseclient import LeaseOpError
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.history.checker import Kind, Status
from tests.history.recorder import Recorder, status_of

KEY = ("t1", "c1")


def params(x: str) -> dict[str, Any]:
    return {"remote_request_id": x, "remote_num_tokens": 0}


def test_a_pull_and_a_release_hand_their_retention_out() -> None:
    rec = Recorder()
    pull = leases_pb2.LookupResponse(decision=leases_pb2.PULL, reason="pull")
    pull.kv_transfer_params.update(params("x1"))
    release = leases_pb2.LookupResponse(decision=leases_pb2.RECOMPUTE, reason="below_threshold")
    release.release_params.update(params("x2"))
    none = leases_pb2.LookupResponse(decision=leases_pb2.RECOMPUTE, reason="already_claimed")
    ops = [rec.lookup("c", KEY, 0.0, r, "r0") for r in (pull, release, none)]
    assert [(o.handed, o.retired, o.detail) for o in ops] == [
        ("x1", "x1", "pull"),
        ("x2", "x2", "below_threshold"),
        ("", "", "already_claimed"),
    ]
    assert all(o.status is Status.OK and o.kind is Kind.LOOKUP for o in ops)
    assert rec.excerpt_lines((ops[0],))[0].endswith("via=r0")


def test_a_replacing_registration_hands_the_replaced_one_out() -> None:
    res = leases_pb2.RegisterLeaseResponse(replaced=True)
    res.release_params.update(params("x1"))
    op = Recorder().register("s", KEY, 0.0, "x2", res)
    assert (op.retention, op.handed, op.retired, op.detail) == ("x2", "x1", "x1", "replaced")


def test_a_revoke_takes_what_it_found_and_hands_out_its_release() -> None:
    rec = Recorder()
    answered = leases_pb2.RevokeLeaseResponse(found=True)
    answered.lease.kv_transfer_params.update(params("x1"))
    answered.release_params.update(params("x1"))
    by_node = leases_pb2.RevokeLeaseResponse(found=True, released_by_node=True)
    by_node.lease.kv_transfer_params.update(params("x2"))
    ops = [rec.revoke("r", KEY, 0.0, r) for r in (answered, by_node, leases_pb2.RevokeLeaseResponse())]
    assert [(o.handed, o.retired, o.detail) for o in ops] == [
        ("x1", "x1", "found"),
        ("", "x2", "released_by_node"),
        ("", "", "not_found"),
    ]


@pytest.mark.parametrize(("reason", "took"), [("conversation_end", ""), ("budget", "x1")])
def test_a_release_over_attach(reason: str, took: str) -> None:
    msg = nodes_pb2.ReleaseRetention(tenant="t1", conversation_id="c1", reason=reason)
    msg.kv_transfer_params.update(params("x1"))
    op = Recorder().release("d-0", msg)
    assert (op.kind, op.handed, op.retired, op.invoked) == (Kind.RELEASE, "x1", took, op.completed)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (LeaseOpError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), Status.FAILED),
        (LeaseOpError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), Status.UNKNOWN),
        (LeaseOpError(grpc.StatusCode.UNAVAILABLE, "broke", True), Status.UNKNOWN),
        (LeaseOpError(grpc.StatusCode.UNAVAILABLE, "never left", True, sent=False), Status.FAILED),
        (TimeoutError(), Status.UNKNOWN),
    ],
)
def test_only_a_proven_refusal_is_a_failure(error: BaseException, status: Status) -> None:
    assert status_of(error)[0] is status


async def test_an_answer_that_came_late_replaces_the_unknown() -> None:
    rec = Recorder()
    unknown = rec.failed(Kind.LOOKUP, "c", KEY, 0.0, LeaseOpError(grpc.StatusCode.DEADLINE_EXCEEDED, "x"))
    late = rec.lookup("c", KEY, 0.0, leases_pb2.LookupResponse(reason="already_claimed"), "r0 late")
    rec.supersede(unknown)
    assert rec.history() == [late]
    await rec.until(lambda o: o.detail == "already_claimed", 1, -1.0)

"""A claim whose caller went away is put back; when the conversation's next registration
(or a revoke) overtakes that put-back, the retention it took is out of etcd for good and
nobody pulls or frees its blocks: the daemon has D's sidecar free them (a ReleaseRetention
on its Attach stream, reason orphan). Never when the retention is back after all."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

from controlplane.daemon import Daemon
from controlplane.errors import StoreUnavailable
from controlplane.records import Retention
from controlplane.service.claims import put_back_orphan
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.conftest import Client
from tests.controlplane.test_cancelled_claims import Answers, slow_claims
from tests.controlplane.test_claims_and_nodes import AttachStream, hello
from tests.factories import d_params, lease_request, lookup_request, node_request


def _orphans() -> float:
    return REGISTRY.get_sample_value("kvferry_retention_releases_total", {"reason": "orphan"}) or 0.0


def _turn(conversation: str, request_id: str) -> leases_pb2.RegisterLeaseRequest:
    """The retention a turn `request_id` of the conversation registers on d-1."""
    req = lease_request(conversation, num_tokens=160, params=d_params("d-1", 160, request_id))
    req.request_id = request_id
    return req


class HeldPutBack:
    """Every put-back (`unclaim`) waits until `go` is set; `tries` counts them."""

    def __init__(self, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
        assert daemon.control_plane is not None
        retentions = daemon.control_plane.owned
        unclaim = retentions.unclaim
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()
        self.results: list[bool | str] = []
        self.lost_answers = 0
        """The first tries whose write goes through but whose answer etcd loses."""
        self.hold_again = False
        """After a lost answer, hold the next try until `go` is set again."""

        async def held(*args: Any, **kwargs: Any) -> bool:
            self.waiting.set()
            await self.go.wait()
            back: bool = await unclaim(*args, **kwargs)
            if self.lost_answers > 0:
                self.lost_answers -= 1
                self.results.append("lost")
                if self.hold_again:  # (the next try waits for `go` again)
                    self.go.clear()
                    self.waiting.clear()
                raise StoreUnavailable("etcd: the answer was lost")
            self.results.append(back)
            return back

        monkeypatch.setattr(retentions, "unclaim", held)


async def _cancelled_claim(daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup of conversation c whose caller goes away once its claim took the retention
    at etcd: its put-back starts (and waits on HeldPutBack.go)."""
    answers = Answers(daemon, monkeypatch)
    written, answer_back = asyncio.Event(), asyncio.Event()

    async def stalled() -> None:
        written.set()
        await answer_back.wait()

    slow_claims(daemon, monkeypatch, stalled)
    call = client.leases.Lookup(lookup_request("c"))
    await asyncio.wait_for(written.wait(), 10)
    call.cancel()
    await asyncio.wait_for(answers.cancelled.wait(), 10)
    answer_back.set()
    with pytest.raises(asyncio.CancelledError):
        await call


async def _attached(client: Client) -> AttachStream:
    await client.nodes.Register(node_request("d-1"), timeout=10)
    stream = AttachStream(client)
    first = await stream.send(hello("d-1"))
    assert first is not None and first.HasField("attached")
    return stream


async def _settled(daemon: Daemon) -> None:
    assert daemon.control_plane is not None
    await asyncio.wait_for(daemon.control_plane.background.settle(), 20)


async def _releases_before_ack(stream: AttachStream) -> list[nodes_pb2.ReleaseRetention]:
    """The releases the stream carries before the answer to a heartbeat sent now."""
    out = []
    nxt = await stream.send(nodes_pb2.AttachRequest(heartbeat=nodes_pb2.Heartbeat(seq=77)))
    while nxt is not None and nxt.HasField("release"):
        out.append(nxt.release)
        nxt = await asyncio.wait_for(stream.call.read(), 10)
    assert nxt is not None and nxt.HasField("heartbeat_ack"), nxt
    return out


async def test_a_put_back_overtaken_by_the_turns_registration_has_d_free_the_blocks(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = await _attached(client)
    try:
        await client.leases.Register(_turn("c", "turn-1"), timeout=10)
        putting = HeldPutBack(daemon, monkeypatch)
        before = _orphans()
        await _cancelled_claim(daemon, client, monkeypatch)
        await asyncio.wait_for(putting.waiting.wait(), 10)
        # The turn went on without the retention and registers its own before the put-back.
        registered = await client.leases.Register(_turn("c", "turn-2"), timeout=10)
        assert not registered.HasField("release_params")  # (turn-1 was not in etcd)
        putting.go.set()

        pushed = await asyncio.wait_for(stream.call.read(), 10)
        assert pushed is not None and pushed.HasField("release"), pushed
        assert (pushed.release.conversation_id, pushed.release.reason) == ("c", "orphan")
        assert struct_to_dict(pushed.release.kv_transfer_params) == {
            **d_params("d-1", 160, "turn-1"),
            "remote_num_tokens": 0,
        }
        assert putting.results == [False]
        assert _orphans() == before + 1
        # turn-2's retention is untouched, for the next turn.
        answer = await client.leases.Lookup(lookup_request("c"), timeout=10)
        assert answer.claimed and answer.decision == leases_pb2.PULL
        assert struct_to_dict(answer.kv_transfer_params)["remote_request_id"] == "turn-2"
    finally:
        await stream.close()


async def test_a_put_back_overtaken_by_a_revoke_has_d_free_the_blocks(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = await _attached(client)
    try:
        await client.leases.Register(_turn("c", "turn-1"), timeout=10)
        putting = HeldPutBack(daemon, monkeypatch)
        await _cancelled_claim(daemon, client, monkeypatch)
        await asyncio.wait_for(putting.waiting.wait(), 10)
        # (the retention is claimed: the revoke finds none to hand back, and takes the marker)
        revoked = await client.leases.Revoke(leases_pb2.RevokeLeaseRequest(conversation_id="c"), timeout=10)
        assert not revoked.found
        putting.go.set()
        pushed = await asyncio.wait_for(stream.call.read(), 10)
        assert pushed is not None and pushed.HasField("release"), pushed
        assert (pushed.release.conversation_id, pushed.release.reason) == ("c", "orphan")
    finally:
        await stream.close()


async def test_a_put_back_written_after_all_is_not_released(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try whose answer etcd lost was written: the next one fails, for the retention is
    back. Releasing it then would free blocks the next turn is handed."""
    stream = await _attached(client)
    try:
        await client.leases.Register(_turn("c", "turn-1"), timeout=10)
        putting = HeldPutBack(daemon, monkeypatch)
        putting.lost_answers = 1
        before = _orphans()
        await _cancelled_claim(daemon, client, monkeypatch)
        putting.go.set()
        await _settled(daemon)
        assert putting.results == ["lost", False]
        assert await _releases_before_ack(stream) == []
        assert _orphans() == before
        answer = await client.leases.Lookup(lookup_request("c"), timeout=10)
        assert answer.claimed and answer.decision == leases_pb2.PULL
        assert struct_to_dict(answer.kv_transfer_params)["remote_request_id"] == "turn-1"
    finally:
        await stream.close()


async def test_a_put_back_whose_answer_was_lost_frees_nothing_the_next_turn_pulled(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try whose answer etcd lost was written: the retention is back, a lookup pulls it,
    and that turn registers its own. The next try then finds another retention there, as
    if the registration had overtaken the put-back; releasing the pulled one then could
    free blocks under its pull (the fault suite's history check found it, 2 s after the
    pull). After a lost answer, nothing is released: D keeps the blocks to its TTL."""
    stream = await _attached(client)
    try:
        await client.leases.Register(_turn("c", "turn-1"), timeout=10)
        putting = HeldPutBack(daemon, monkeypatch)
        putting.lost_answers, putting.hold_again = 1, True
        before = _orphans()
        await _cancelled_claim(daemon, client, monkeypatch)
        await asyncio.wait_for(putting.waiting.wait(), 10)  # (the first try)
        putting.waiting.clear()
        putting.go.set()
        await asyncio.wait_for(putting.waiting.wait(), 10)  # (the second try, held)
        assert putting.results == ["lost"]
        pulled = await client.leases.Lookup(lookup_request("c"), timeout=10)
        assert pulled.claimed and pulled.decision == leases_pb2.PULL
        assert struct_to_dict(pulled.kv_transfer_params)["remote_request_id"] == "turn-1"
        await client.leases.Register(_turn("c", "turn-2"), timeout=10)
        putting.go.set()
        await _settled(daemon)
        assert putting.results == ["lost", False]
        assert await _releases_before_ack(stream) == []
        assert _orphans() == before
    finally:
        await stream.close()


async def test_a_put_back_overtaken_on_a_restarted_engine_releases_nothing(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D restarted meanwhile (a new generation), and the turn registered on it: the old
    blocks went with the restart."""
    stream = await _attached(client)
    await client.leases.Register(_turn("c", "turn-1"), timeout=10)
    putting = HeldPutBack(daemon, monkeypatch)
    before = _orphans()
    await _cancelled_claim(daemon, client, monkeypatch)
    await asyncio.wait_for(putting.waiting.wait(), 10)
    await client.nodes.Register(node_request("d-1"), timeout=10)  # generation 2
    await stream.close()
    restarted = AttachStream(client)
    try:
        first = await restarted.send(hello("d-1", 2))
        assert first is not None and first.HasField("attached")
        await client.leases.Register(_turn("c", "turn-2"), timeout=10)
        putting.go.set()
        await _settled(daemon)
        assert putting.results == [False]
        assert await _releases_before_ack(restarted) == []
        assert _orphans() == before
    finally:
        await restarted.close()


def _retention(request_id: str, params: bytes) -> Retention:
    return Retention(
        engine_id="d-1",
        generation=1,
        params=params,
        num_tokens=160,
        block_size=16,
        created_at=0.0,
        expires_at=100.0,
        digests=b"",
        request_id=request_id,
    )


@pytest.mark.parametrize(
    ("current", "marked", "orphan"),
    [
        (None, False, True),  # revoked meanwhile (the revoke took the marker)
        (None, True, False),  # a later claim took what was there: maybe it, put back after all
        ("next", False, True),  # the turn's own registration overtook the put-back
        ("next", True, True),  # ... with this claim's marker still there
        ("same-params", False, False),  # back after all
        ("same-request", True, False),  # the sidecar registered it again
    ],
)
def test_which_failed_put_backs_leave_blocks_to_nobody(
    current: str | None, marked: bool, orphan: bool
) -> None:
    taken = _retention("turn-1", b"p1")
    now: dict[str | None, Retention | None] = {
        None: None,
        "next": _retention("turn-2", b"p2"),
        "same-params": _retention("", b"p1"),
        "same-request": _retention("turn-1", b"p1-again"),
    }
    assert put_back_orphan(taken, now[current], marked) is orphan

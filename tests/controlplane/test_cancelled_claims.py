"""A unary Leases/Lookup whose caller goes away (its deadline, a cancel) while the claim is
at etcd: the claim may be written with nobody to get its answer, so what it took goes
back for the next turn. A retention is answered once or claimable again: never spent
silently, never both."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from controlplane.daemon import Daemon
from controlplane.errors import StoreUnavailable
from controlplane.service.lookups import LookupResult
from controlplane.store.retentions import ClaimOutcome
from kvferry.v1 import leases_pb2
from tests.conftest import Client
from tests.factories import lease_request, lookup_request, node_request
from tests.polling import eventually


class Answers:
    """The daemon's lookups as they end: answered (claimed or not) or cancelled."""

    def __init__(self, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
        assert daemon.control_plane is not None
        lookups = daemon.control_plane.lookups
        lookup = lookups.lookup
        self.claimed: list[str] = []  # the conversations whose retention an answer handed out
        self.running = 0
        self.cancelled = asyncio.Event()

        async def recorded(q: Any, later: Any = None) -> LookupResult:
            self.running += 1
            try:
                result = await lookup(q, later)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            finally:
                self.running -= 1
            if result.claimed:
                self.claimed.append(q.conversation_id)
            return result

        monkeypatch.setattr(lookups, "lookup", recorded)
        lookup_now = lookups.lookup_now

        def recorded_now(q: Any) -> LookupResult | None:  # (answered at once: nothing to cancel)
            result = lookup_now(q)
            if result is not None and result.claimed:
                self.claimed.append(q.conversation_id)
            return result

        monkeypatch.setattr(lookups, "lookup_now", recorded_now)


def slow_claims(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, after_write: Callable[[], Awaitable[None]]
) -> None:
    """Make every claim's answer come back from etcd only once `after_write()` returns
    (the transaction itself is written at once). Every claim takes the awaited path, as
    one does when its shard is owned elsewhere or not yet in memory: the one a caller's
    cancellation can cut into."""
    assert daemon.control_plane is not None
    retentions = daemon.control_plane.owned
    claim = retentions.claim
    monkeypatch.setattr(retentions, "claim_now", lambda *args, **kwargs: None)

    async def slow(*args: Any, **kwargs: Any) -> ClaimOutcome:
        outcome = await claim(*args, **kwargs)
        await after_write()
        return outcome

    monkeypatch.setattr(retentions, "claim", slow)


async def claimable(client: Client, conversation: str) -> bool:
    """The conversation's retention is there for the next lookup (a peek claims nothing)."""
    peek = await client.leases.Lookup(lookup_request(conversation, peek=True))
    return peek.reason != "already_claimed"


async def test_a_lookup_cancelled_while_its_claim_is_at_etcd_puts_it_back(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    answers = Answers(daemon, monkeypatch)
    written, answer_back = asyncio.Event(), asyncio.Event()

    async def stalled() -> None:
        written.set()
        await answer_back.wait()

    slow_claims(daemon, monkeypatch, stalled)
    call = client.leases.Lookup(lookup_request("c"))
    await written.wait()  # the retention is taken at etcd; its answer is on its way
    call.cancel()
    await answers.cancelled.wait()  # the daemon saw the caller go
    answer_back.set()
    with pytest.raises(asyncio.CancelledError):
        await call

    await eventually(lambda: claimable(client, "c"))
    res = await client.leases.Lookup(lookup_request("c"))
    assert res.claimed and res.decision == leases_pb2.PULL
    assert answers.claimed == ["c"]  # handed out once: to the next lookup


async def test_lookups_racing_their_deadlines_spend_no_retention_silently(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.nodes.Register(node_request("d-1"))
    conversations = [f"r{i}" for i in range(40)]
    for c in conversations:
        await client.leases.Register(lease_request(c))
    answers = Answers(daemon, monkeypatch)
    rng = random.Random(21)

    async def etcd_latency() -> None:
        await asyncio.sleep(rng.uniform(0, 0.04))

    slow_claims(daemon, monkeypatch, etcd_latency)
    calls = [client.leases.Lookup(lookup_request(c), timeout=rng.uniform(0.002, 0.08)) for c in conversations]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        assert not isinstance(r, BaseException) or (
            isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ), r

    async def each_answered_or_back() -> bool:
        back = [await claimable(client, c) for c in conversations]
        return all((c in answers.claimed) != b for c, b in zip(conversations, back, strict=True))

    await eventually(each_answered_or_back, within=10)
    cp = daemon.control_plane
    assert cp is not None

    async def quiet() -> bool:
        return answers.running == 0 and cp.background.idle

    await eventually(quiet)
    assert await each_answered_or_back()  # and it stays so
    assert len(set(answers.claimed)) == len(answers.claimed)  # none handed out twice
    for c in conversations:
        if c not in answers.claimed:
            res = await client.leases.Lookup(lookup_request(c))
            assert res.claimed and res.decision == leases_pb2.PULL, (c, res)


async def test_a_put_back_etcd_does_not_answer_is_tried_again(
    daemon: Daemon, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c"))
    answers = Answers(daemon, monkeypatch)
    written, answer_back = asyncio.Event(), asyncio.Event()

    async def stalled() -> None:
        written.set()
        await answer_back.wait()

    slow_claims(daemon, monkeypatch, stalled)
    assert daemon.control_plane is not None
    retentions = daemon.control_plane.owned
    unclaim = retentions.unclaim
    tries: list[str] = []

    async def flaky(*args: Any, **kwargs: Any) -> bool:
        tries.append("try")
        if len(tries) <= 2:  # (a leader election: the first two tries get no answer)
            raise StoreUnavailable("etcd: no leader")
        return await unclaim(*args, **kwargs)

    monkeypatch.setattr(retentions, "unclaim", flaky)
    call = client.leases.Lookup(lookup_request("c"))
    await written.wait()
    call.cancel()
    await answers.cancelled.wait()
    answer_back.set()
    with pytest.raises(asyncio.CancelledError):
        await call

    await eventually(lambda: claimable(client, "c"))
    assert len(tries) == 3
    res = await client.leases.Lookup(lookup_request("c"))
    assert res.claimed and res.decision == leases_pb2.PULL
    assert answers.claimed == ["c"]

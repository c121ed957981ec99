"""Leases/Stream (the sidecar's and router's path) and the KV-event block index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from controlplane.blockindex import BlockIndex, IndexUpdate
from kvferry.v1 import leases_pb2, nodes_pb2, nodes_pb2_grpc
from tests.conftest import Client, free_port
from tests.factories import lease_request, lookup_request, node_request, tokens
from tests.polling import eventually


async def test_stream_multiplexes_register_and_lookup_with_per_op_errors(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    ops = [leases_pb2.LeaseOp(id=i, register=lease_request(f"s-{i}")) for i in range(50)]
    bad = lease_request("s-bad")
    bad.num_tokens = -1
    ops.append(leases_pb2.LeaseOp(id=999, register=bad))
    ops.append(leases_pb2.LeaseOp(id=1000))  # no op at all

    async def run(items: list[leases_pb2.LeaseOp]) -> list[leases_pb2.LeaseOpResult]:
        # Written explicitly, several ops per message as LeaseStream sends them, then half-closed.
        call = client.leases.Stream()
        for i in range(0, len(items), 7):
            await call.write(leases_pb2.LeaseOpBatch(ops=items[i : i + 7]))
        await call.done_writing()
        return [r async for batch in call for r in batch.results]

    results = {r.id: r for r in await run(ops)}
    assert set(results) == set(range(50)) | {999, 1000}
    assert all(results[i].WhichOneof("result") == "register" for i in range(50))
    assert results[999].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "num_tokens -1" in results[999].error.message
    assert results[1000].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    lookups = [leases_pb2.LeaseOp(id=i, lookup=lookup_request(f"s-{i % 50}")) for i in range(100)]
    answers = await run(lookups)
    pulls = [r for r in answers if r.lookup.decision == leases_pb2.PULL]
    assert len(answers) == 100 and len(pulls) == 50, "each lease handed out exactly once"
    assert {r.id % 50 for r in pulls} == set(range(50))


async def _two_prefills_p1_attached(
    client: Client,
) -> tuple[asyncio.Queue[nodes_pb2.AttachRequest | None], Any]:
    """Prefill nodes p-1 and p-2, and an Attach stream for p-1 (greeted): -> (the queue its
    requests are put in, None to end it; the call)."""
    await client.nodes.Register(node_request("p-1", role=nodes_pb2.PREFILL))
    await client.nodes.Register(node_request("p-2", role=nodes_pb2.PREFILL, side_channel_port=5601))
    return await _attached(client, "p-1")


async def _attached(
    client: Client, engine_id: str
) -> tuple[asyncio.Queue[nodes_pb2.AttachRequest | None], Any]:
    """An Attach stream for `engine_id` at generation 1, greeted: -> (the queue its requests
    are put in, None to end it; the call)."""
    queue: asyncio.Queue[nodes_pb2.AttachRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[nodes_pb2.AttachRequest]:
        while (item := await queue.get()) is not None:
            yield item

    call = client.nodes.Attach(requests())
    queue.put_nowait(nodes_pb2.AttachRequest(hello=nodes_pb2.AttachHello(engine_id=engine_id, generation=1)))
    await call.read()
    return queue, call


async def test_kv_events_feed_the_index_and_score(client: Client) -> None:
    queue, call = await _two_prefills_p1_attached(client)
    batches = [
        nodes_pb2.KvEventBatch(seq=0, stored=[1, 2, 3, 4, 5]),
        nodes_pb2.KvEventBatch(seq=1, removed=[4], stored=[6]),
        nodes_pb2.KvEventBatch(seq=2, cleared=True, stored=[1, 2, 3]),
    ]
    for b in batches:
        queue.put_nowait(nodes_pb2.AttachRequest(kv_events=b))
    beat = nodes_pb2.Heartbeat(seq=1, uncaptured_turns=4, unretained_blocks=9)
    queue.put_nowait(nodes_pb2.AttachRequest(heartbeat=beat))
    ack = await call.read()  # the heartbeat ack: everything before it was applied
    assert ack.heartbeat_ack == nodes_pb2.Heartbeat(seq=1)  # (the counts are not sent back)
    listed = {n.engine_id: n for n in (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes}
    assert listed["p-1"].indexed_blocks == 3 and listed["p-2"].indexed_blocks == 0
    # The sidecar's counts of turns whose blocks D pins with no retention, as it last said.
    assert (listed["p-1"].uncaptured_turns, listed["p-1"].unretained_blocks) == (4, 9)
    assert (listed["p-2"].uncaptured_turns, listed["p-2"].unretained_blocks) == (0, 0)
    score = await client.nodes.Score(
        nodes_pb2.ScoreRequest(block_hashes=[1, 2, 9, 10], role=nodes_pb2.PREFILL)
    )
    assert [(s.engine_id, s.cached_blocks) for s in score.scores] == [("p-1", 2), ("p-2", 0)]
    # A block held deeper in a chain means its prefix was computed there: the index may
    # have missed some of it (see BlockIndex.leading).
    score = await client.nodes.Score(
        nodes_pb2.ScoreRequest(block_hashes=[1, 9, 2, 3], role=nodes_pb2.PREFILL)
    )
    assert [(s.engine_id, s.cached_blocks) for s in score.scores] == [("p-1", 4), ("p-2", 0)]
    queue.put_nowait(None)
    call.cancel()

    async def dropped() -> bool:  # a detached node's index would go stale (and it is suspended)
        request = nodes_pb2.ListNodesRequest(include_dead=True)
        listed = {n.engine_id: n for n in (await client.nodes.List(request)).nodes}
        return listed["p-1"].indexed_blocks == 0 and listed["p-1"].unretained_blocks == 0

    await eventually(dropped)


async def test_a_new_attach_stream_starts_the_nodes_index_afresh(client: Client) -> None:
    """A second Attach for the node (its sidecar restarted, or failed over back here):
    what the first stream indexed is not the new one's view, and went on scoring until the
    new one's first batch (for good when it sends no KV events)."""
    queue, call = await _two_prefills_p1_attached(client)
    queue.put_nowait(nodes_pb2.AttachRequest(kv_events=nodes_pb2.KvEventBatch(seq=0, stored=[1, 2, 3])))
    queue.put_nowait(nodes_pb2.AttachRequest(heartbeat=nodes_pb2.Heartbeat(seq=1)))
    await call.read()

    async def indexed() -> int:
        listed = {n.engine_id: n for n in (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes}
        return listed["p-1"].indexed_blocks

    assert await indexed() == 3
    second, new = await _attached(client, "p-1")
    assert await indexed() == 0
    for q, c in ((queue, call), (second, new)):
        q.put_nowait(None)
        c.cancel()


async def test_score_on_any_replica_sees_every_replicas_sidecars(make_daemon, connect) -> None:  # type: ignore[no-untyped-def]
    """A sidecar's KV events reach the replica it attached to; a router asking another
    replica still scores that node by them (the replicas ask each other)."""
    a = await make_daemon()
    b = await make_daemon(etcd=a.settings.etcd)  # same etcd, same prefix: two replicas
    ca, cb = connect(a), connect(b)
    queue, call = await _two_prefills_p1_attached(ca)  # p-1's sidecar attaches to replica a
    queue.put_nowait(nodes_pb2.AttachRequest(kv_events=nodes_pb2.KvEventBatch(seq=0, stored=[1, 2, 3])))
    beat = nodes_pb2.Heartbeat(seq=1, uncaptured_turns=2, unretained_blocks=5)
    queue.put_nowait(nodes_pb2.AttachRequest(heartbeat=beat))
    await call.read()
    ask = nodes_pb2.ScoreRequest(block_hashes=[1, 2, 9], role=nodes_pb2.PREFILL)

    async def b_knows_a() -> bool:
        return b.peers is not None and b.peers.addresses == [a.address]

    await eventually(b_knows_a)
    await eventually(lambda: _score_of(cb, ask, "p-1", expect=2))
    scores = await cb.nodes.Score(ask)
    assert [(s.engine_id, s.cached_blocks) for s in scores.scores] == [("p-1", 2), ("p-2", 0)]
    local = await cb.nodes.Score(nodes_pb2.ScoreRequest(block_hashes=[1, 2, 9], local_only=True))
    assert {s.engine_id: s.cached_blocks for s in local.scores} == {"p-1": 0, "p-2": 0}

    # Nodes/List's counts too (a router asks Score only when some node indexes blocks).
    def counts(listed: nodes_pb2.ListNodesResponse) -> dict[str, tuple[int, int, int]]:
        return {
            n.engine_id: (n.indexed_blocks, n.uncaptured_turns, n.unretained_blocks) for n in listed.nodes
        }

    listed = await cb.nodes.List(nodes_pb2.ListNodesRequest())
    assert counts(listed) == {"p-1": (3, 2, 5), "p-2": (0, 0, 0)}
    listed = await cb.nodes.List(nodes_pb2.ListNodesRequest(local_only=True))
    assert counts(listed) == {"p-1": (0, 0, 0), "p-2": (0, 0, 0)}
    queue.put_nowait(None)
    call.cancel()


async def test_a_peer_that_does_not_answer_is_left_alone_for_a_while() -> None:
    """A dead replica's announcement lives up to its lease's TTL: it must not cost every
    scoring turn the peers' deadline meanwhile."""
    from controlplane.peers import Peers

    peers = Peers(None, backoff_s=30.0)  # type: ignore[arg-type]  # (no store: nothing announced)
    await peers._follow({"dead": f"127.0.0.1:{free_port()}"})  # nothing listens there
    ask = nodes_pb2.ScoreRequest(block_hashes=[1])
    assert await peers.scores(ask, 1.0) == []
    [dead] = peers._peers.values()
    assert dead.skip_until["Score"] > 0  # failed: skipped from now on
    asked: list[object] = []
    dead.stub.Score = lambda *args, **kwargs: asked.append(args)  # type: ignore[method-assign]
    assert await peers.scores(ask, 1.0) == []
    assert asked == []  # not asked again
    assert "List" not in dead.skip_until  # (each kind of call on its own)
    assert await peers.attached_counts(1.0) == {} and dead.skip_until["List"] > 0
    await peers._follow({})  # gone from etcd: its channel closes
    assert peers.addresses == []
    await peers.close()


async def test_a_peer_late_only_for_a_callers_short_deadline_is_asked_again() -> None:
    """A caller with little time left shortens the peers' deadline: a peer that misses only
    that shortened deadline is not left out for the backoff (every Score would then miss
    its sidecars' blocks for 5 s after one slow moment), and with no time left none is asked."""

    from controlplane.peers import Peers

    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _, w: accepted.append(w), "127.0.0.1", 0)  # never answers
    port = server.sockets[0].getsockname()[1]
    peers = Peers(None, deadline_s=0.05, backoff_s=30.0)  # type: ignore[arg-type]
    try:
        await peers._follow({"slow": f"127.0.0.1:{port}"})
        [slow] = peers._peers.values()
        ask = nodes_pb2.ScoreRequest(block_hashes=[1])
        asked = 0
        score = slow.stub.Score

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal asked
            asked += 1
            return score(*args, **kwargs)

        slow.stub.Score = counted  # type: ignore[method-assign]
        assert await peers.scores(ask, 0.001) == [] and asked == 0  # no time: not asked at all
        for _ in range(2):  # (5 ms for the peer: missed; asked again next time)...
            assert await peers.scores(ask, 0.01) == [] and slow.skip_until.get("Score", 0) == 0
        assert (
            await peers.scores(ask, 0.01) == [] and slow.skip_until["Score"] > 0
        )  # ...but late 3 in a row: hung
        slow.skip_until["Score"] = 0
        assert await peers.scores(ask, 1.0) == []  # the whole deadline missed: left alone at once
        assert slow.skip_until["Score"] > 0 and asked == 4
    finally:
        await peers.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_replica_whose_announcement_lapsed_announces_itself_again(make_daemon) -> None:  # type: ignore[no-untyped-def]
    """Its lease gone (an etcd outage longer than the TTL, a restore), a replica puts its
    key back with a new lease at the next refresh, and the others find it again."""
    a = await make_daemon()
    b = await make_daemon(etcd=a.settings.etcd)
    assert a.peers is not None and b.peers is not None and a._store is not None

    async def b_knows_a() -> bool:
        return b.peers.addresses == [a.address]  # type: ignore[union-attr]

    await eventually(b_knows_a)
    first = a.peers._lease
    await a._store.revoke_lease_quietly(first)  # the key goes with it
    assert a.address not in (await a._store.replicas()).values()

    async def announced_again() -> bool:
        return a.address in (await a._store.replicas()).values()  # type: ignore[union-attr]

    await eventually(announced_again)
    assert a.peers._lease != first
    await eventually(b_knows_a)


async def _score_of(client: Client, ask: nodes_pb2.ScoreRequest, engine: str, expect: int) -> bool:
    scores = await client.nodes.Score(ask)
    return any(s.engine_id == engine and s.cached_blocks == expect for s in scores.scores)


def test_a_deeper_block_held_vouches_for_the_prefix_the_index_missed() -> None:
    """Chained hashes: a block held at position k was computed after the whole prefix.
    A sidecar that started late never heard of a hot prefix's first blocks (vLLM
    announces a block once, when first cached): the node still scores its depth."""
    idx = BlockIndex()
    prompt = list(range(100, 164))  # 64 blocks
    idx.apply("late", IndexUpdate(stored=prompt[40:]))  # the first 40 announced before it joined
    idx.apply("cold", IndexUpdate(stored=[1, 2, 3]))
    assert idx.leading("late", prompt) == 64
    assert idx.leading("late", prompt[:50]) == 50
    assert idx.leading("late", [*prompt[:41], 999]) == 41  # (probed: position 40 held)
    assert idx.leading("cold", prompt) == 0
    assert idx.score(["cold", "late"], prompt) == [("late", 64), ("cold", 0)]


def test_block_index_applies_net_effect_in_order() -> None:
    idx = BlockIndex()
    idx.apply("a", IndexUpdate(stored=[1, 2, 3]))
    idx.apply("a", IndexUpdate(stored=[4], removed=[2]))
    assert idx.count("a") == 3 and not idx.contains("a", 2) and idx.leading("a", [1, 3, 4, 2]) == 3
    idx.apply("a", IndexUpdate(stored=[7], cleared=True))
    assert idx.count("a") == 1
    idx.apply("a", IndexUpdate(stored=[8], reset=True))
    assert idx.count("a") == 1 and idx.contains("a", 8)
    idx.drop("a")
    assert idx.total() == 0


def test_a_node_index_past_any_engines_size_is_emptied_not_grown() -> None:
    """Hashes beyond what an engine can cache come from a wrong or hostile Attach stream
    (nothing authenticates one): the index is emptied, the other nodes' left alone."""
    idx = BlockIndex(max_blocks=100)
    assert idx.apply("b", IndexUpdate(stored=[1, 2]))
    assert idx.apply("a", IndexUpdate(stored=list(range(100))))
    assert not idx.apply("a", IndexUpdate(stored=[1000]))
    assert idx.count("a") == 0 and idx.count("b") == 2
    assert idx.apply("a", IndexUpdate(stored=[5], reset=True)) and idx.count("a") == 1


async def test_lease_stream_client_batches_under_load_and_survives_timeouts(client: Client) -> None:
    from kvferry.leaseclient import LeaseOpError, LeaseStream

    await client.nodes.Register(node_request("d-1"))
    stream = LeaseStream(client.channel)
    try:
        regs = await asyncio.gather(*(stream.register(lease_request(f"b-{i}"), 10) for i in range(200)))
        assert all(r.lease.engine_id == "d-1" for r in regs)
        looks = await asyncio.gather(*(stream.lookup(lookup_request(f"b-{i}"), 10) for i in range(200)))
        assert all(r.decision == leases_pb2.PULL for r in looks)
        bad = lease_request("b-bad")
        bad.conversation_id = ""
        with pytest.raises(LeaseOpError) as refused:
            await stream.register(bad, 10)
        e = refused.value
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "conversation_id" in e.message
        assert not e.stream_lost  # the daemon's answer to that op: no reason to change replica
        # A deadline too short to be met fails that call only; the stream goes on.
        with pytest.raises(LeaseOpError) as late:
            await stream.lookup(lookup_request("b-0"), 0.000001)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not late.value.stream_lost
        again = await stream.lookup(lookup_request("b-1", peek=True), 10)
        assert again.reason == "already_claimed"
    finally:
        await stream.close()


def test_batches_are_cut_by_encoded_size_in_order() -> None:
    from kvferry.framing import by_size

    ops = [
        leases_pb2.LookupRequest(conversation_id=c * size)
        for c, size in zip("abcdef", (40, 40, 40, 200, 10, 10), strict=True)
    ]
    sizes = [op.ByteSize() for op in ops]
    runs = list(by_size(ops, budget=100))
    assert [op for run in runs for op in run] == ops
    assert [len(run) for run in runs] == [2, 1, 1, 2]  # the 200-byte one alone, over the budget
    assert all(sum(op.ByteSize() for op in run) <= 100 for run in runs if len(run) > 1)
    assert sizes[3] > 100
    assert list(by_size(ops[3:4], budget=1)) == [ops[3:4]]


async def test_long_conversations_ops_and_answers_stay_under_the_message_limit(client: Client) -> None:
    """100 registrations of 64k-token conversations at once (~11 MB) and their 100 PULL
    answers (~4.5 MB): in one message each, over the daemon's 4 MiB limit and this client's,
    gRPC would end the stream and fail every op on it."""
    from kvferry.leaseclient import LeaseStream

    await client.nodes.Register(node_request("d-1"))
    n = 65536
    seq = tokens(n)
    reqs = [lease_request(f"long-{i}", num_tokens=n, seq=seq) for i in range(100)]
    assert sum(r.ByteSize() for r in reqs) > 8 * 1024 * 1024
    prompt = lookup_request("", prompt_tokens=n + 100, seq=seq + tokens(100, start=7))
    stream = LeaseStream(client.channel)
    try:
        regs = await asyncio.gather(*(stream.register(r, 60) for r in reqs))
        assert all(r.lease.num_tokens == n for r in regs)
        looks = []
        for i in range(100):
            ask = leases_pb2.LookupRequest()
            ask.CopyFrom(prompt)
            ask.conversation_id = f"long-{i}"
            looks.append(stream.lookup(ask, 60))
        answers = await asyncio.gather(*looks)
        assert all(a.decision == leases_pb2.PULL and a.reusable_tokens == n for a in answers)
        assert sum(a.ByteSize() for a in answers) > 4 * 1024 * 1024
    finally:
        await stream.close()


async def test_a_lost_lease_stream_says_so() -> None:
    """No daemon at the address: the op fails as UNAVAILABLE with stream_lost, the one case
    in which the sidecar moves to another replica."""
    from kvferry.leaseclient import LeaseOpError, LeaseStream

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}")
    stream = LeaseStream(channel)
    try:
        await stream.register(lease_request("x"), 10)
        raise AssertionError("expected an error")
    except LeaseOpError as e:
        assert e.code == grpc.StatusCode.UNAVAILABLE and e.stream_lost
        assert not e.sent  # it never left: sending it again is safe
    finally:
        await stream.close()
        await channel.close(None)


def _stream_on(call: Any, late_answer_s: float = 10.0) -> tuple[Any, grpc.aio.Channel]:
    """A LeaseStream whose Leases/Stream call is `call` (the test's), and its channel
    (never used; close it)."""
    from kvferry.leaseclient import LeaseStream

    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    stream = LeaseStream(channel, late_answer_s)
    stream._stub = type("Stub", (), {"Stream": lambda self: call})()
    return stream, channel


class _StuckCall:
    """A Leases/Stream call whose first write never completes (a daemon that stopped
    reading: gRPC flow control holds the client back)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self._never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def write(self, batch: leases_pb2.LeaseOpBatch) -> None:
        self.written += [op.id for op in batch.ops]
        await self._never

    async def read(self) -> Any:
        await self._never

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _ScriptedCall:
    """A Leases/Stream call whose answers the test hands over (`answer`, `end`)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self._results: asyncio.Queue[Any] = asyncio.Queue()

    async def write(self, batch: leases_pb2.LeaseOpBatch) -> None:
        self.written += [op.id for op in batch.ops]

    async def read(self) -> Any:
        return await self._results.get()

    def answer(self, result: leases_pb2.LeaseOpResult) -> None:
        self._results.put_nowait(leases_pb2.LeaseOpResultBatch(results=[result]))

    def end(self) -> None:
        self._results.put_nowait(grpc.aio.EOF)  # type: ignore[attr-defined]

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass


async def test_late_answers_reach_the_hook_only_when_they_are_answers() -> None:
    """A lookup given up on (deadline, cancelled caller) still hands a later answer to its
    hook; not an error answer, not after the stream's late_answer_s, not when the stream
    ends first. Nothing is left behind either way."""
    from kvferry.leaseclient import LeaseOpError

    first = _ScriptedCall()
    stream, channel = _stream_on(first, late_answer_s=0.2)
    hooked: list[leases_pb2.LookupResponse] = []

    async def given_up(conversation: str) -> None:
        async def prompt() -> leases_pb2.LookupPrompt:
            return leases_pb2.LookupPrompt(prompt_tokens=100)

        with pytest.raises(LeaseOpError):
            await stream.lookup_with_prompt(
                leases_pb2.LookupRequest(conversation_id=conversation), prompt(), 0.01, hooked.append
            )

    await given_up("error")  # op 1
    first.answer(leases_pb2.LeaseOpResult(id=1, error=leases_pb2.OpError(code=14, message="etcd down")))
    await given_up("expired")  # op 2
    await asyncio.sleep(0.3)  # past late_answer_s: no longer waited for
    first.answer(leases_pb2.LeaseOpResult(id=2, lookup=leases_pb2.LookupResponse(reason="too late")))
    await given_up("answered")  # op 3
    first.answer(
        leases_pb2.LeaseOpResult(id=3, lookup=leases_pb2.LookupResponse(reason="pull", claimed=True))
    )
    await given_up("stream ends")  # op 4
    await asyncio.sleep(0.05)
    first.end()
    await asyncio.sleep(0.05)
    assert [h.reason for h in hooked] == ["pull"]
    assert not stream._pending and not stream._written and not stream._outbox
    assert first.written == [1, 1, 2, 2, 3, 3, 4, 4]  # each lookup, then its prompt
    await stream.close()
    await channel.close(None)


async def test_an_op_given_up_on_says_whether_it_left() -> None:
    """`sent` is what the sidecar goes by to send a registration again or not: an op in a
    write that never finished may still reach the daemon; one still waiting to leave when
    its caller gives up is taken back, and never leaves."""
    from kvferry.leaseclient import LeaseOpError

    call = _StuckCall()
    stream, channel = _stream_on(call)
    first = asyncio.ensure_future(stream.register(lease_request("a"), 0.3))
    await asyncio.sleep(0.05)  # the writer is stuck in the write of the first op
    with pytest.raises(LeaseOpError) as second:
        await stream.register(lease_request("b"), 0.1)
    assert second.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not second.value.sent
    with pytest.raises(LeaseOpError) as stuck:
        await first
    assert stuck.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and stuck.value.sent
    assert call.written == [1]  # the second op never left, nor will it
    assert not stream._outbox and not stream._pending and not stream._written
    await stream.close()
    await channel.close(None)


async def test_a_lookup_given_up_on_before_it_left_never_leaves() -> None:
    """Not even with a late hook: sent later (the stream was still connecting), it would
    claim what the conversation holds by then, which may be the retention of the very
    turn that went on without it; releasing that costs the next turn its reuse, and the
    blocks it should have freed stay held for D's TTL."""
    from kvferry.leaseclient import LeaseOpError

    call = _StuckCall()
    stream, channel = _stream_on(call)
    stuck = asyncio.ensure_future(stream.register(lease_request("a"), 0.5))
    await asyncio.sleep(0.05)  # the writer is stuck in the write of the first op
    hooked: list[leases_pb2.LookupResponse] = []

    async def prompt() -> leases_pb2.LookupPrompt:
        return leases_pb2.LookupPrompt(prompt_tokens=100)

    with pytest.raises(LeaseOpError) as late:
        await stream.lookup_with_prompt(
            leases_pb2.LookupRequest(conversation_id="c"), prompt(), 0.05, hooked.append
        )
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not late.value.sent
    assert not stream._outbox and list(stream._pending) == [1]  # only the stuck register
    with pytest.raises(LeaseOpError):
        await stuck
    assert call.written == [1] and not hooked
    await stream.close()
    await channel.close(None)


async def test_a_stream_whose_results_are_not_read_stops_reading_its_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Results wait for a client that does not read them: at most a window of them, then the
    daemon stops taking ops from that stream (and gRPC flow control holds the client)."""
    from controlplane import server

    monkeypatch.setattr(server, "STREAM_WINDOW", 4)
    pulled = 0

    async def ops() -> AsyncIterator[leases_pb2.LeaseOpBatch]:
        nonlocal pulled
        for i in range(50):
            pulled += 1  # a prompt for no waiting lookup: refused at once, no store needed
            yield leases_pb2.LeaseOpBatch(ops=[leases_pb2.LeaseOp(id=i, prompt=leases_pb2.LookupPrompt())])

    servicer = server.LeasesServicer(None)  # type: ignore[arg-type]
    results = servicer.Stream(ops(), None)  # type: ignore[arg-type]
    first = await results.__anext__()  # the client reads once, then stops
    await asyncio.sleep(0.2)
    # (a window sent, a window waiting to be, and the batch the reader holds)
    assert 1 <= len(first.results) <= 4 and pulled <= 2 * 4 + 2, (len(first.results), pulled)
    got = len(first.results)
    async for batch in results:  # reading again lets the rest through
        got += len(batch.results)
    assert got == 50 and pulled == 50


async def test_the_daemon_allows_its_clients_keepalive_pings(
    make_daemon, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Routers and sidecars ping the daemon on idle connections (kvferry.channels). A server
    that allows fewer pings answers the third with GOAWAY too_many_pings, ending every
    stream on the connection, and the client then pings half as often. Here every second
    (the fewest gRPC clients send) instead of every 10 s."""
    import controlplane.server
    import kvferry.channels

    monkeypatch.setattr(kvferry.channels, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(controlplane.server, "KEEPALIVE_TIME_MS", 1000)
    daemon = await make_daemon()
    channel = grpc.aio.insecure_channel(daemon.address, options=kvferry.channels.daemon_channel_options(1000))
    try:
        await nodes_pb2_grpc.NodesStub(channel).List(nodes_pb2.ListNodesRequest())
        states = set()
        for _ in range(40):  # idle, pinging
            states.add(channel.get_state())
            await asyncio.sleep(0.1)
        assert states == {grpc.ChannelConnectivity.READY}, states  # (a GOAWAY leaves it IDLE)
    finally:
        await channel.close(None)

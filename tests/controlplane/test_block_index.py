"""The KV-event block index: Attach streams feed it, Nodes/Score and Nodes/List read it,
on one replica or across replicas (which ask each other: controlplane.peers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from controlplane.blockindex import BlockIndex, IndexUpdate
from kvferry.v1 import nodes_pb2
from realvllm.process import free_port
from tests.conftest import Client
from tests.factories import node_request
from tests.polling import eventually


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
    assert await peers.scores([1], 0, 1.0) == []
    [dead] = peers._peers.values()
    assert dead.skip_until["Score"] > 0  # failed: skipped from now on
    asked: list[object] = []
    dead.stub.Score = lambda *args, **kwargs: asked.append(args)  # type: ignore[method-assign]
    assert await peers.scores([1], 0, 1.0) == []
    assert asked == []  # not asked again
    assert "List" not in dead.skip_until  # (each kind of call on its own)
    assert await peers.node_lists(1.0) == [] and dead.skip_until["List"] > 0
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
        asked = 0
        score = slow.stub.Score

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal asked
            asked += 1
            return score(*args, **kwargs)

        slow.stub.Score = counted  # type: ignore[method-assign]
        assert await peers.scores([1], 0, 0.001) == [] and asked == 0  # no time: not asked at all
        for _ in range(2):  # (5 ms for the peer: missed; asked again next time)...
            assert await peers.scores([1], 0, 0.01) == [] and slow.skip_until.get("Score", 0) == 0
        assert (
            await peers.scores([1], 0, 0.01) == [] and slow.skip_until["Score"] > 0
        )  # ...but late 3 in a row: hung
        slow.skip_until["Score"] = 0
        assert await peers.scores([1], 0, 1.0) == []  # the whole deadline missed: left alone at once
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
    await a._store.replicas.withdraw(first)  # the key goes with it
    assert a.address not in (await a._store.replicas.announced()).values()

    async def announced_again() -> bool:
        return a.address in (await a._store.replicas.announced()).values()  # type: ignore[union-attr]

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

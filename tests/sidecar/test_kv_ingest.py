"""KV events engine -> sidecar -> daemon index, over real ZMQ and a real daemon."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from structlog.testing import capture_logs

from controlplane.daemon import Daemon
from emulator import EmulatorServer
from kvferry.blockhash import external_block_hash
from kvferry.v1 import nodes_pb2
from realvllm.process import free_port
from sidecar import Sidecar
from tests.conftest import Client, DaemonFactory
from tests.factories import VECTORS
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar
from tests.sidecar.helpers import FakePublisher, chat, first_turn

KV = {"kv_events_port": 0, "kv_events_replay_port": 0}


def engine_cache(emu: EmulatorServer) -> set[int]:
    """The hashes the emulated engine caches, as its events name them (test-only peek)."""
    return {external_block_hash(h) for h in emu.engine.pool._cached}


async def index_of(client: Client, engine_id: str, expected: set[int]) -> bool:
    """Whether the daemon's index of `engine_id` is exactly `expected`."""
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    node = next((n for n in nodes if n.engine_id == engine_id), None)
    if node is None or node.indexed_blocks != len(expected):
        return False
    if not expected:
        return True
    scores = await client.nodes.Score(nodes_pb2.ScoreRequest(block_hashes=sorted(expected)))
    return any(s.engine_id == engine_id and s.cached_blocks == len(expected) for s in scores.scores)


async def subscribed(sc: Sidecar, ranks: int = 1) -> None:
    """Until the sidecar's KV-event ingest has caught up by replay, on each rank (its SUB
    connected before): traffic sent earlier could fall between the two and be a gap."""

    async def replayed() -> bool:
        return sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="complete") >= ranks

    await eventually(replayed)


async def _traffic(http: aiohttp.ClientSession, url: str, topics: list[str]) -> None:
    for topic in topics:
        answer = await chat(http, url, first_turn(topic), max_tokens=20, ignore_eos=True)
        assert answer.status == 200, answer.body


async def test_the_index_follows_the_engine_through_evictions_and_resets(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    d = await start_emulator(role="both", num_blocks=48, **KV)
    sc = await start_sidecar(d)
    node_id = sc.settings.node_id
    await subscribed(sc)
    await _traffic(http, sc.url, ["ferries", "harbours", "lighthouses", "tides"])  # 48 blocks: evictions
    await eventually(lambda: index_of(client, node_id, engine_cache(d)))
    assert engine_cache(d)
    assert sc.metrics.value("kvferry_sidecar_kv_events_decoded_total", type="BlockRemoved") > 0

    async with http.post(sc.url + "/reset_prefix_cache") as r:
        assert r.status == 200
    await eventually(lambda: index_of(client, node_id, set()))
    await _traffic(http, d.http_url, ["canals"])
    await eventually(lambda: index_of(client, node_id, engine_cache(d)))
    assert sc.metrics.value("kvferry_sidecar_kv_gaps_total") == 0


def _port_run(count: int) -> int:
    """A port p with p .. p + count - 1 all free on loopback (as a data-parallel engine's
    publishers bind them)."""
    for _ in range(100):
        base = free_port()
        if base + count > 65536:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base + 1, base + count):
                    stack.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
        return base
    raise RuntimeError("no run of free ports")


async def test_a_data_parallel_engine_is_followed_rank_by_rank(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """vLLM with --data-parallel-size 2: each rank publishes its own cache on the ports
    plus its rank. The node's index is their union; one rank's reset leaves the other's
    blocks, those of a prefix both ranks hold too."""
    pub = _port_run(4)
    replay = pub + 2
    ranks = [
        await start_emulator(role="both", kv_events_port=pub + r, kv_events_replay_port=replay + r)
        for r in range(2)
    ]
    sc = await start_sidecar(ranks[0], kv_events__ranks=2)
    node_id = sc.settings.node_id
    await subscribed(sc, ranks=2)
    await _traffic(http, sc.url, ["ferries"])
    await _traffic(http, ranks[1].http_url, ["harbours", "ferries"])  # (vLLM's DP balancer sent it there)
    both = engine_cache(ranks[0]) | engine_cache(ranks[1])
    assert engine_cache(ranks[0]) & engine_cache(ranks[1])  # the shared prefix: on both ranks
    await eventually(lambda: index_of(client, node_id, both))
    async with http.post(ranks[1].http_url + "/reset_prefix_cache") as r:
        assert r.status == 200
    await eventually(lambda: index_of(client, node_id, engine_cache(ranks[0])))
    assert sc.metrics.value("kvferry_sidecar_kv_gaps_total") == 0


async def test_a_late_joiner_catches_up_by_replay(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    d = await start_emulator(role="both", **KV)
    await _traffic(http, d.http_url, ["ferries", "harbours"])  # before any sidecar listens
    sc = await start_sidecar(d)
    await eventually(lambda: index_of(client, sc.settings.node_id, engine_cache(d)))
    assert sc.metrics.value("kvferry_sidecar_kv_payloads_total", source="replay") > 0
    assert sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="complete") >= 1


class _Dropping:
    """The publisher's PUB socket, losing the messages whose seq is in `drop` (a lossy network)."""

    def __init__(self, socket: Any, drop: set[int]) -> None:
        self._socket = socket
        self.drop = drop

    async def send_multipart(self, frames: list[bytes]) -> None:
        if int.from_bytes(frames[1], "big", signed=True) in self.drop:
            return
        await self._socket.send_multipart(frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


async def test_lost_messages_are_replayed_and_the_index_is_exact(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    d = await start_emulator(role="both", num_blocks=100, **KV)
    sc = await start_sidecar(d)
    node_id = sc.settings.node_id
    await _traffic(http, d.http_url, ["ferries"])
    await eventually(lambda: index_of(client, node_id, engine_cache(d)))
    publisher = d._publisher
    assert publisher is not None
    published = publisher.published
    publisher._pub = _Dropping(publisher._pub, {published, published + 2, published + 3})  # type: ignore[assignment]
    await _traffic(http, d.http_url, ["harbours", "lighthouses", "tides"])
    await eventually(lambda: index_of(client, node_id, engine_cache(d)))
    assert sc.metrics.value("kvferry_sidecar_kv_gaps_total") >= 1
    assert sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="complete") >= 2  # start + gap


@pytest.fixture
async def fake() -> AsyncIterator[FakePublisher]:
    pub = FakePublisher()
    await pub.start()
    yield pub
    await pub.close()


async def _counted(sc: Sidecar, name: str) -> bool:
    return sc.metrics.value(name) > 0


def _maps(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


async def test_a_batch_too_deeply_nested_to_decode_is_skipped_and_the_next_ones_apply(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, fake: FakePublisher
) -> None:
    """msgspec gives up on a payload nested thousands deep with RecursionError, not a
    DecodeError: it must count as malformed like any other, not stall the stream on it
    (every later batch read as a gap, replayed, and failing on it again)."""
    d = await start_emulator(role="decode")
    sc = await start_sidecar(
        d, kv_events__endpoint=fake.endpoint, kv_events__replay_endpoint=fake.replay_endpoint
    )
    await fake.publish(0, _maps({"type": "BlockStored", "block_hashes": [1]}))
    # an event whose unknown field (skipped, so decoded in full) nests 3,000 arrays deep
    head = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [2], "x": 0}]])
    deep = b"\x93" + head[1:-1] + b"\x91" * 3000 + b"\x90" + msgspec.msgpack.encode(0)
    await fake.publish(1, deep)
    for seq in range(2, 6):
        await fake.publish(seq, _maps({"type": "BlockStored", "block_hashes": [seq + 10]}))
    await eventually(lambda: index_of(client, sc.settings.node_id, {1, 12, 13, 14, 15}))
    assert sc.metrics.value("kvferry_sidecar_kv_events_malformed_total") == 1
    assert fake.replays == [0]  # the start's catch-up only: nothing was missing


@pytest.mark.parametrize("legacy", [False, True], ids=["vllm-0.32-shape", "older-shape"])
async def test_a_late_joiner_catches_up_from_either_replay_shape(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, legacy: bool
) -> None:
    """vLLM 0.32 answers a replay with [topic, seq, payload] and ends it with [b"", -1, b""]
    (the sidecar read those as malformed, never saw the end, timed out and reset the index);
    older releases and SGLang with [seq, payload] and [-1, b""]. Both are followed, with
    payloads vLLM's own classes encoded."""
    fake = FakePublisher(topic=b"kv", legacy_replay=legacy)
    await fake.start()
    try:
        await fake.publish(0, (VECTORS / "kv_events_batch_vllm_0.33.0.msgpack").read_bytes(), deliver=False)
        await fake.publish(
            1, (VECTORS / "kv_events_batch_bytes_hashes_vllm_0.33.0.msgpack").read_bytes(), deliver=False
        )
        await fake.publish(2, _maps({"type": "BlockStored", "block_hashes": [7]}), deliver=False)
        d = await start_emulator(role="decode")
        sc = await start_sidecar(
            d,
            kv_events__endpoint=fake.endpoint,
            kv_events__replay_endpoint=fake.replay_endpoint,
            kv_events__topic="kv",
        )
        # batch 0 stores and then clears everything; batch 1 stores one block by its raw digest
        digest = int.from_bytes(bytes(range(32))[-8:], "big")
        await eventually(lambda: index_of(client, sc.settings.node_id, {digest, 7}), within=15)
        assert sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="complete") == 1
        assert sc.metrics.value("kvferry_sidecar_kv_payloads_total", source="replay") == 3
        assert sc.metrics.value("kvferry_sidecar_kv_events_malformed_total") == 0
    finally:
        await fake.close()


async def test_a_flood_of_malformed_messages_is_counted_and_logged_sparingly(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, fake: FakePublisher
) -> None:
    """An engine (or anything else on the endpoint) sending bad frames in a tight loop: each
    is counted, the log gets a line now and then (it got one per message)."""
    d = await start_emulator(role="decode")
    sc = await start_sidecar(
        d, kv_events__endpoint=fake.endpoint, kv_events__replay_endpoint=fake.replay_endpoint
    )
    seq = 0

    async def live() -> bool:  # (until the SUB is connected: a message before that is lost)
        nonlocal seq
        await fake.publish(seq, _maps({"type": "BlockStored", "block_hashes": [seq + 1]}))
        seq += 1
        return sc.metrics.value("kvferry_sidecar_kv_payloads_total", source="live") > 0

    await eventually(live, within=10, interval=0.1)
    with capture_logs() as logs:
        for _ in range(500):
            await fake.pub.send_multipart([b"", b"not a seq"])  # two frames, not three
        await eventually(lambda: _at_least(sc, "kvferry_sidecar_kv_events_malformed_total", 500), within=10)
    warnings = [e for e in logs if e["event"] == "kvevents.payload.malformed"]
    assert 1 <= len(warnings) <= 2, len(warnings)  # (a second, should the flood straddle 10 s)
    assert sc.metrics.value("kvferry_sidecar_kv_events_malformed_total") == 500
    # and the stream goes on
    await fake.publish(seq, _maps({"type": "BlockStored", "block_hashes": [1000]}))
    await eventually(lambda: index_of(client, sc.settings.node_id, {*range(1, seq + 1), 1000}))


async def _at_least(sc: Sidecar, name: str, value: float) -> bool:
    return sc.metrics.value(name) >= value


async def test_a_replay_longer_than_its_answer_timeout_completes(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, fake: FakePublisher
) -> None:
    """vLLM replays up to 10,000 batches: the timeout is per answer, not for the whole
    replay (which then ended as a timeout, reset the index and paused replays for 5 s)."""
    for seq in range(20):
        await fake.publish(seq, _maps({"type": "BlockStored", "block_hashes": [seq + 1]}), deliver=False)
    fake.replay_pace_s = 0.1  # 2 s in all, against a 1.5 s answer timeout (a stall is no timeout)
    d = await start_emulator(role="decode")
    sc = await start_sidecar(
        d,
        kv_events__endpoint=fake.endpoint,
        kv_events__replay_endpoint=fake.replay_endpoint,
        kv_events__replay_timeout_s=1.5,
    )
    await eventually(lambda: index_of(client, sc.settings.node_id, set(range(1, 21))), within=15)
    assert sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="complete") == 1
    assert sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="timeout") == 0


async def test_encodings_malformed_payloads_gaps_and_restarts(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, fake: FakePublisher
) -> None:
    d = await start_emulator(role="decode")  # the HTTP engine; its KV events come from `fake`
    sc = await start_sidecar(
        d, kv_events__endpoint=fake.endpoint, kv_events__replay_endpoint=fake.replay_endpoint
    )
    node_id = sc.settings.node_id

    async def index(expected: set[int]) -> None:
        await eventually(lambda: index_of(client, node_id, expected))

    await fake.publish(0, _maps({"type": "BlockStored", "block_hashes": [1, 2, 3]}))
    await fake.publish(
        1, msgspec.msgpack.encode([1.0, [["BlockStored", [4], 3, [], 16, None], ["BlockRemoved", [1]]]])
    )
    with capture_logs() as logs:
        await fake.publish(2, b"\x93garbage")
        await eventually(lambda: _counted(sc, "kvferry_sidecar_kv_events_malformed_total"))
    assert [e["seq"] for e in logs if e["event"] == "kvevents.payload.malformed"] == [2]
    await fake.publish(
        3, _maps({"type": "BlockEvicted?", "block_hashes": [2]}, {"type": "BlockStored", "block_hashes": [5]})
    )
    await index({2, 3, 4, 5})
    assert sc.metrics.value("kvferry_sidecar_kv_events_malformed_total") == 1
    assert sc.metrics.value("kvferry_sidecar_kv_events_unknown_total") == 1

    await fake.publish(4, _maps({"type": "BlockStored", "block_hashes": [6]}), deliver=False)  # lost
    await fake.publish(5, _maps({"type": "BlockStored", "block_hashes": [7]}))
    await index({2, 3, 4, 5, 6, 7})
    assert 4 in fake.replays

    await fake.publish(6, _maps({"type": "BlockStored", "block_hashes": [8]}), deliver=False)
    fake.kept.pop()  # ... and gone from the engine's replay buffer too
    await fake.publish(7, _maps({"type": "BlockStored", "block_hashes": [9]}))
    await index({2, 3, 4, 5, 6, 7, 9})  # the best the sidecar can know
    assert sc.metrics.value("kvferry_sidecar_kv_replays_total", outcome="incomplete") == 1

    await fake.publish(8, _maps({"type": "BlockStored", "block_hashes": [10]}))
    await index({2, 3, 4, 5, 6, 7, 9, 10})
    fake.kept.clear()
    await fake.publish(0, _maps({"type": "BlockStored", "block_hashes": [100]}))  # a new engine
    await index({100})
    assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="kv_seq") == 1
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    assert [n.generation for n in nodes if n.engine_id == node_id] == [2]


async def test_batches_delivered_again_are_skipped_not_taken_for_a_restart(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, fake: FakePublisher
) -> None:
    """A batch seen twice (a duplicate delivery, a replay overlapping the live stream) once
    the replay's window has closed: its seq is at or a little below the last one, which
    was read as a new engine, bumping the node's generation and voiding every retention
    of D. Skipped now, the index as it was; a seq back at 0 is still a restart."""
    d = await start_emulator(role="decode")
    sc = await start_sidecar(
        d, kv_events__endpoint=fake.endpoint, kv_events__replay_endpoint=fake.replay_endpoint
    )
    node_id = sc.settings.node_id
    await subscribed(sc)
    for seq in range(4):
        await fake.publish(seq, _maps({"type": "BlockStored", "block_hashes": [seq + 1]}))
    await eventually(lambda: index_of(client, node_id, {1, 2, 3, 4}))  # (live: the window closed)

    async def again(seq: int) -> None:  # what the engine already sent, sent again
        await fake.pub.send_multipart(
            [b"", seq.to_bytes(8, "big", signed=True), _maps({"type": "AllBlocksCleared"})]
        )

    for seq in (3, 3, 1, 2):
        await again(seq)
    await fake.publish(4, _maps({"type": "BlockStored", "block_hashes": [5]}))
    await eventually(lambda: index_of(client, node_id, {1, 2, 3, 4, 5}))
    assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="kv_seq") == 0
    assert sc.metrics.value("kvferry_sidecar_kv_payloads_total", source="live") == 9
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    assert [n.generation for n in nodes if n.engine_id == node_id] == [1]

    fake.kept.clear()
    await fake.publish(0, _maps({"type": "BlockStored", "block_hashes": [100]}))  # a new engine
    await eventually(lambda: index_of(client, node_id, {100}))
    assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="kv_seq") == 1
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest())).nodes
    assert [n.generation for n in nodes if n.engine_id == node_id] == [2]


async def test_another_replica_rebuilds_the_index_after_failover(
    daemon: Daemon,
    client: Client,
    make_daemon: DaemonFactory,
    connect: Callable[[Daemon], Client],
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    other = await make_daemon(etcd=daemon.settings.etcd)  # a second replica: same etcd, same prefix
    d = await start_emulator(role="both", **KV)
    sc = await start_sidecar(d, daemon__addresses=(daemon.address, other.address))
    node_id = sc.settings.node_id
    await _traffic(http, d.http_url, ["ferries"])
    await eventually(lambda: index_of(client, node_id, engine_cache(d)))
    await daemon.stop()
    await eventually(lambda: index_of(connect(other), node_id, engine_cache(d)), within=10)


async def test_changes_reach_the_daemon_without_waiting_for_a_heartbeat(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, fake: FakePublisher
) -> None:
    d = await start_emulator(role="decode")
    sc = await start_sidecar(
        d,
        kv_events__endpoint=fake.endpoint,
        kv_events__replay_endpoint=fake.replay_endpoint,
        daemon__liveness_ttl_s=30,
    )  # heartbeats every 10 s: a change must not wait for one (bounds below: far under that,
    # far over what a loaded 2-core machine takes)
    node_id = sc.settings.node_id
    await eventually(lambda: index_of(client, node_id, set()))
    loop = asyncio.get_running_loop()
    began = loop.time()
    await fake.publish(0, _maps({"type": "BlockStored", "block_hashes": [1]}))
    await eventually(lambda: index_of(client, node_id, {1}))
    assert loop.time() - began < 4.0
    burst = list(range(10, 10 + 60 * 1024))  # several flushes' worth
    began = loop.time()
    for i in range(60):
        chunk = burst[i * 1024 : (i + 1) * 1024]
        await fake.publish(1 + i, _maps({"type": "BlockStored", "block_hashes": chunk}))
    await eventually(lambda: index_of(client, node_id, {1, *burst}), within=9)
    assert loop.time() - began < 7.0

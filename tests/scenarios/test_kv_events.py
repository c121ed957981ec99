"""D's KV events, on both backends: the sidecar's mirror and the daemon's index of the
node hold exactly the blocks the engine says it holds (its own events from seq 0, read
by the test), however the sidecar came to them: started after the engine had served
other turns, restarted while the engine served more, or missing live messages."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from kvferry.v1 import nodes_pb2
from sidecar import Sidecar
from tests.polling import eventually
from tests.router.helpers import CHAT, first_turn
from tests.scenarios.conftest import Deployment
from tests.scenarios.helpers import KvReference, post_json


async def served_directly(dep: Deployment, topic: str) -> None:
    """A request straight to D's engine (no kvferry on its way): D caches its blocks."""
    body = {
        "model": dep.engines.model,
        "messages": first_turn(topic, size=6),
        "max_tokens": 8,
        "temperature": 0,
    }
    await post_json(dep.http, dep.engines.decode.http_url + CHAT, body)


async def mirrored(dep: Deployment, sidecar: Sidecar) -> None:
    """Until the sidecar's mirror and the daemon's index equal what D holds."""
    reference = KvReference(dep.engines.decode.kv_events_replay_endpoint)
    node_id = sidecar.settings.node_id

    seen: list[str] = []

    async def same() -> bool:
        held = await reference.blocks()
        mirror = sidecar.mirror.hashes()
        listed = await dep.client.nodes.List(nodes_pb2.ListNodesRequest())
        alive = [n for n in listed.nodes if n.engine_id == node_id]
        if not alive:  # (a stopped sidecar's node is suspended until it registers again)
            seen[:] = [f"node {node_id} is not alive at the daemon"]
            return False
        [node] = alive
        seen[:] = [
            f"D holds {len(held)}, mirror {len(mirror)} ({len(mirror - held)} not held, "
            f"{len(held - mirror)} missing), daemon indexes {node.indexed_blocks}"
        ]
        return mirror == held and node.indexed_blocks == len(held)

    try:
        await eventually(same, within=60, interval=0.2)
    except TimeoutError:
        raise AssertionError(seen[0]) from None


async def test_a_sidecar_started_after_other_turns_mirrors_what_d_holds(deployment: Deployment) -> None:
    dep = deployment
    await served_directly(dep, "a late sidecar")
    await mirrored(dep, dep.sidecars["decode"])
    assert dep.sidecars["decode"].mirror.hashes(), "D holds no blocks: nothing was checked"


async def test_a_restarted_sidecar_replays_what_it_missed(deployment: Deployment) -> None:
    dep = deployment
    await dep.stop_sidecar("decode")
    await served_directly(dep, "while the sidecar was away")
    sidecar = await dep.start_sidecar("decode")
    await mirrored(dep, sidecar)


@contextlib.asynccontextmanager
async def lossy_forwarder(upstream: str, drop: set[int]) -> AsyncIterator[tuple[str, list[int]]]:
    """A PUB endpoint relaying `upstream`'s messages but the `drop`th ones (counted from 1):
    -> (its endpoint, the seqs dropped so far)."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(upstream)
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    dropped: list[int] = []

    async def relay() -> None:
        n = 0
        while True:
            frames = await sub.recv_multipart()
            n += 1
            if n in drop:
                dropped.append(int.from_bytes(frames[1], "big"))
                continue
            await pub.send_multipart(frames)

    task = asyncio.create_task(relay())
    try:
        yield f"tcp://127.0.0.1:{port}", dropped
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sub.close(linger=0)
        pub.close(linger=0)
        ctx.term()


async def test_a_sidecar_missing_live_messages_replays_the_gap(deployment: Deployment) -> None:
    dep = deployment
    await dep.stop_sidecar("decode")
    engine = dep.engines.decode
    # (a lost message shows as a gap when the next one comes: none is dropped last)
    async with lossy_forwarder(engine.kv_events_endpoint, drop={1, 3}) as (endpoint, dropped):
        sidecar = await dep.start_sidecar("decode", events_endpoint=endpoint)
        await mirrored(dep, sidecar)
        for n in range(4):
            await served_directly(dep, f"gaps in the stream {n}")

        async def lost_some() -> bool:
            return len(dropped) >= 2

        await eventually(lost_some, within=30)
        await served_directly(dep, "after the gaps")
        await mirrored(dep, sidecar)
        assert sidecar.metrics.value("kvferry_sidecar_kv_gaps_total") >= 1

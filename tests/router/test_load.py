"""Many conversations at once, router replicas, and a daemon that dies mid-run."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.daemon_workload import DaemonProcess
from router import Router
from tests.polling import eventually
from tests.router.conftest import MakeStack, Reference
from tests.router.helpers import CHAT, Result, ask, first_turn, next_turn, unheld_reads


@dataclass
class Conversation:
    cid: str
    messages: list[dict[str, Any]]
    results: list[Result] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def turn(self, http: aiohttp.ClientSession, router: Router, stream: bool = False) -> Result:
        """The next turn; a JSON answer unless `stream` (a streamed one registers nothing to
        pull: vLLM 0.32's streams carry no kv_transfer_params, nor do the emulator's)."""
        if self.results:
            self.messages = next_turn(
                self.messages, self.results[-1].text, f"Step {len(self.results)}: go on. "
            )
        body = {"messages": self.messages, "max_tokens": 24, "conversation_id": self.cid, "stream": stream}
        res = await ask(http, router.url, body, {"Authorization": f"Bearer key-{hash(self.cid) % 7}"})
        self.bodies.append(body)
        self.results.append(res)
        return res


async def _check_answers(convs: list[Conversation], reference: Reference) -> int:
    """Every answer equals the no-reuse answer; -> number of turns checked."""
    sem = asyncio.Semaphore(16)

    async def one(body: dict[str, Any], res: Result) -> None:
        async with sem:
            assert res.text == await reference(CHAT, body), body["conversation_id"]

    pairs = [(b, r) for c in convs for b, r in zip(c.bodies, c.results, strict=True)]
    await asyncio.gather(*(one(b, r) for b, r in pairs))
    return len(pairs)


async def test_two_replicas_taking_alternate_turns_reuse_as_often_as_one(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    stack = await make_stack()
    a = await stack.router()
    b = await stack.router()

    async def run(routers: list[Router], tag: str) -> list[Conversation]:
        convs = [Conversation(f"{tag}-{i}", first_turn(f"topic {tag} {i}")) for i in range(6)]
        for t in range(4):
            results = await asyncio.gather(*(c.turn(http, routers[t % len(routers)]) for c in convs))
            assert all(r.status == 200 for r in results)
            await stack.registrations_idle()
        return convs

    alone = await run([a], "one")
    pair = await run([a, b], "two")
    pulls_alone = sum(r.decision == "PULL" for c in alone for r in c.results)
    pulls_pair = sum(r.decision == "PULL" for c in pair for r in c.results)
    assert pulls_alone == pulls_pair == 6 * 3
    assert (
        b.metrics.value("kvferry_router_lookups_total", decision="PULL", reason="partial_pull")
        + b.metrics.value("kvferry_router_lookups_total", decision="PULL", reason="pull")
        == 6 * 2
    )  # b served turns 2 and 4 of every "two" conversation, and pulled every time
    await _check_answers(pair, reference)
    assert unheld_reads(stack.decodes) == 0  # no retention was handed out twice


async def test_200_concurrent_conversations_survive_a_daemon_killed_mid_run(
    etcd_endpoint: str, make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    # A daemon process of its own, to SIGKILL: no graceful stop, no claims put back.
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    daemon = DaemonProcess(None, etcd=etcd_endpoint, prefix=prefix)
    await daemon.start()
    back = DaemonProcess(
        None, etcd=etcd_endpoint, prefix=prefix, port=daemon.port, stream_port=daemon.stream_port
    )
    try:
        await _survive_a_kill(daemon, back, make_stack, http, reference)
    finally:
        await daemon.kill()
        await back.stop()


async def _survive_a_kill(
    daemon: DaemonProcess,
    back: DaemonProcess,
    make_stack: MakeStack,
    http: aiohttp.ClientSession,
    reference: Reference,
) -> None:
    stack = await make_stack(d_config={"num_blocks": 65536}, daemon=daemon)
    router = await stack.router(daemon__lookup_deadline_s=2.0)
    convs = [Conversation(f"c{i}", first_turn(f"subject {i}", size=2)) for i in range(200)]

    # Turn 1 for everyone at once, half of them streamed (those leave nothing to pull).
    one = await asyncio.gather(*(c.turn(http, router, stream=i % 2 == 0) for i, c in enumerate(convs)))
    assert all(r.status == 200 for r in one)
    await stack.registrations_idle(20)

    # Turn 2 for everyone: half are running when the daemon dies, the rest arrive after.
    two, late = await _turn_two_across_a_kill(convs, daemon, http, router)
    assert all(r.status == 200 for r in two), [r.body for r in two if r.status != 200][:3]
    assert any(r.decision == "PULL" for r in two)  # before the kill
    assert not any(r.decision == "PULL" for r in two[::2])  # (their turn one streamed)
    assert all(r.decision == "SKIPPED" and r.reason.startswith("daemon_") for r in late)

    # Turns while the daemon is down: served, without reuse.
    while_down = await asyncio.gather(*(c.turn(http, router) for c in convs[:20]))
    assert all(r.status == 200 and r.decision == "SKIPPED" for r in while_down)

    # A daemon comes back on the same address and etcd: reuse resumes.
    await back.start()
    await stack.wait_nodes(20)
    await stack.registrations_idle(20)
    await asyncio.sleep(1.2)  # the router's breaker lets lookups through again within 1 s
    three = await asyncio.gather(*(c.turn(http, router) for c in convs[20:]))
    assert all(r.status == 200 for r in three)
    pulled = sum(r.decision == "PULL" for r in three)
    # Only a registration the kill caught at the daemon is lost (sending it again could
    # hand out D's blocks twice): its conversation recomputes once. And a retention the
    # killed daemon held: it may have been handed out from its memory, not yet in etcd
    # (controlplane.owners), so the daemon that takes over spends it, and D's sidecar is
    # told to free its blocks (reason failover), after a grace.
    [d] = stack.decodes
    sidecar = stack.sidecar(d).metrics
    lost = sidecar.value("kvferry_sidecar_lease_registrations_dropped_total", reason="maybe_stored")

    async def explained() -> bool:
        failover = sidecar.value("kvferry_sidecar_releases_total", reason="failover")
        return pulled >= len(three) - lost - failover

    await eventually(explained, within=30)

    assert await _check_answers(convs, reference) == 200 * 2 + 20 + 180
    assert router.metrics.value("kvferry_router_upstream_errors_total", role="decode", kind="status_5xx") == 0
    assert unheld_reads(stack.decodes) == 0  # no retention was handed out twice, even across the restart


async def _turn_two_across_a_kill(
    convs: list[Conversation], daemon: DaemonProcess, http: aiohttp.ClientSession, router: Router
) -> tuple[list[Result], list[Result]]:
    """Turn 2 of the first 100 conversations, the daemon killed when 30 are done, then turn 2
    of the other 100: -> (every turn two's answer, those of the turns sent after the kill)."""
    done, midway = 0, asyncio.Event()

    async def turn_two(c: Conversation) -> Result:
        nonlocal done
        res = await c.turn(http, router)
        done += 1
        if done == 30:
            midway.set()
        return res

    early = asyncio.gather(*(turn_two(c) for c in convs[:100]))
    async with asyncio.timeout(30):
        await midway.wait()
    await daemon.kill()  # 70 of the first 100 still in flight
    late = await asyncio.gather(*(turn_two(c) for c in convs[100:]))
    return [*await early, *late], late

"""Streamed turns on an engine whose streams carry no kv_transfer_params (vLLM 0.32; the
emulator's default), on both backends: the client is served, nothing is retained (the
next turn recomputes), and the blocks D pins for the turn anyway are counted, block for
block as D's own metrics show them, and shown on D's node."""

from __future__ import annotations

from kvferry.v1 import nodes_pb2
from tests.polling import eventually
from tests.router.helpers import Result, ask, next_turn
from tests.scenarios.conftest import Deployment
from tests.scenarios.helpers import scrape

UNCAPTURED = "kvferry_sidecar_uncaptured_turns_total"
UNRETAINED = "kvferry_sidecar_unretained_blocks"


async def streamed(dep: Deployment, body: dict[str, object]) -> Result:
    got = await ask(dep.http, dep.router.url, {**body, "stream": True})
    assert got.status == 200, got.body
    assert got.events and got.events[-1] == "[DONE]" and got.text
    assert not any(isinstance(e, dict) and "error" in e for e in got.events)
    return got


async def test_a_streamed_turn_is_served_and_its_pinned_blocks_counted(deployment: Deployment) -> None:
    dep = deployment
    d = dep.sidecars["decode"]
    conversation = dep.conversation("streamed")
    # (its first words are its own: no block of it is shared with another request on D)
    messages = [{"role": "user", "content": f"{conversation}: tell me about streamed turns. " * 12}]
    body = {"model": dep.engines.model, "messages": messages, "max_tokens": 12, "temperature": 0}
    before = (await scrape(dep.http, dep.engines.decode.http_url)).used_blocks

    first = await streamed(dep, {**body, "conversation_id": conversation})
    assert first.decision == "RECOMPUTE", first.reason

    async def counted() -> bool:  # (the tap concludes once the stream has ended)
        return d.metrics.value(UNCAPTURED) == 1

    await eventually(counted, within=30)
    assert d.metrics.value("kvferry_sidecar_turns_total", outcome="stream_without_params") == 1
    unretained = int(d.metrics.value(UNRETAINED))
    assert unretained > 0

    async def as_d_says() -> bool:  # (vLLM's gauges follow its steps)
        used = (await scrape(dep.http, dep.engines.decode.http_url)).used_blocks
        return used - before == unretained

    await eventually(as_d_says, within=60, interval=0.2)
    reference = await ask(dep.http, dep.plain.url, body)  # (after the count: it pins blocks too)
    assert reference.status == 200 and first.text == reference.text

    # Nothing was retained: the next turn recomputes its history.
    second = await streamed(
        dep, {**body, "messages": next_turn(messages, first.text), "conversation_id": conversation}
    )
    assert (second.decision, second.reason) == ("RECOMPUTE", "no_lease")

    async def shown() -> bool:
        listed = await dep.client.nodes.List(nodes_pb2.ListNodesRequest())
        node = next(n for n in listed.nodes if n.engine_id == d.settings.node_id)
        pinned = int(d.metrics.value(UNRETAINED))
        return d.metrics.value(UNCAPTURED) == 2 and (node.uncaptured_turns, node.unretained_blocks) == (
            2,
            pinned,
        )

    await eventually(shown, within=60, interval=0.2)  # (the next heartbeat brings them)

"""The router sends a prompt to the prefill node whose prefix cache holds it.

Everything is real: two caching P emulators publishing KV events through their
sidecars into the daemon's block index, the router asking ``Nodes/Score``. Without
scoring, the router alternates between equally loaded P; with it, a prompt whose
blocks one P already holds goes to that P, which then computes only the new part.
"""

from __future__ import annotations

import asyncio

import aiohttp

from emulator import EmulatorServer
from kvferry.v1 import nodes_pb2
from router.choice import worth_scoring
from tests.polling import eventually
from tests.router.conftest import MakeStack, Stack
from tests.router.helpers import ask, first_turn, next_turn


async def indexed(stack: Stack, emu: EmulatorServer, more_than: int) -> int:
    """Until the daemon's index holds more than `more_than` blocks of `emu`."""
    engine = stack.sidecar(emu).settings.node_id
    async with asyncio.timeout(10):
        while True:
            listed = await stack.client.nodes.List(nodes_pb2.ListNodesRequest())
            blocks = {n.engine_id: n.indexed_blocks for n in listed.nodes}.get(engine, 0)
            if blocks > more_than:
                return blocks
            await asyncio.sleep(0.05)


async def test_a_prompt_goes_to_the_prefill_node_holding_its_prefix(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    stack = await make_stack(prefill=2, p_config={"enable_prefix_caching": True, "kv_events_port": 0})
    router = await stack.router()
    prefills = stack.prefills
    directory = router.directory
    assert directory is not None

    async def will_score() -> bool:
        return worth_scoring(directory.nodes)

    known = {id(p): 0 for p in prefills}
    for i in range(4):
        messages = first_turn(f"harbour {i}", size=30)
        served = [p.engine.metrics.total("vllm:prompt_tokens") for p in prefills]
        one = await ask(http, router.url, {"messages": messages, "max_tokens": 8})
        assert one.status == 200
        [first] = [
            p
            for p, before in zip(prefills, served, strict=True)
            if p.engine.metrics.total("vllm:prompt_tokens") > before
        ]
        known[id(first)] = await indexed(stack, first, known[id(first)])
        await eventually(will_score)  # the router's node list (refreshed every 0.2 s) sees it too

        served = [p.engine.metrics.total("vllm:prompt_tokens") for p in prefills]
        hits = first.engine.metrics.total("vllm:prefix_cache_hits")
        two = await ask(http, router.url, {"messages": next_turn(messages, one.text), "max_tokens": 8})
        assert two.status == 200
        chosen = [
            p
            for p, before in zip(prefills, served, strict=True)
            if p.engine.metrics.total("vllm:prompt_tokens") > before
        ]
        assert chosen == [first], f"prompt {i} went to the other prefill node"
        assert (
            first.engine.metrics.total("vllm:prefix_cache_hits") - hits >= 16 * 10
        )  # it reused what it held
        known[id(first)] = await indexed(stack, first, known[id(first)])

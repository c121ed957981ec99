"""Blocks kept for a next turn are let go on purpose, on both backends: `kvferry leases
revoke` frees D's blocks at once (D's own metrics show it), and a release leaves nothing
pinned anywhere (P's own metrics show no block held once it is done)."""

from __future__ import annotations

import json
import math

from kvferry.v1 import leases_pb2
from tests.cli.test_operator_tools import BIN, run
from tests.polling import eventually
from tests.scenarios.conftest import Deployment
from tests.scenarios.helpers import scrape
from tests.scenarios.test_conversations import reused_turn

KVFERRY = str(BIN / "kvferry")


async def held_turn(dep: Deployment, topic: str) -> tuple[str, int]:
    """One turn of a new conversation, registered: -> (its id, the blocks D keeps for it,
    none shared with another request: its first words are its own)."""
    conversation = dep.conversation(topic)
    body = {
        "model": dep.engines.model,
        "messages": [{"role": "user", "content": f"{conversation}: tell me about {topic}. " * 12}],
        "max_tokens": 12,
        "temperature": 0,
        "conversation_id": conversation,
    }
    await reused_turn(dep, body)
    lease = await dep.client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id=conversation))
    return conversation, math.ceil(lease.num_tokens / lease.block_size)


async def p_holds_nothing(dep: Deployment) -> None:
    async def nothing() -> bool:
        return (await scrape(dep.http, dep.engines.prefill.http_url)).used_blocks == 0

    await eventually(nothing, within=60, interval=0.2)


async def test_revoke_frees_ds_blocks_and_pins_nothing(deployment: Deployment) -> None:
    dep = deployment
    conversation, blocks = await held_turn(dep, "revoked at once")
    await p_holds_nothing(dep)  # (the turn's own P blocks went to D)
    before = (await scrape(dep.http, dep.engines.decode.http_url)).used_blocks
    code, out, err = await run(
        KVFERRY, "leases", "revoke", conversation, "--json", "--daemon", dep.daemon.address
    )
    assert code == 0, err
    assert json.loads(out)["release"]["sent"] is True, out

    async def freed() -> bool:
        used = (await scrape(dep.http, dep.engines.decode.http_url)).used_blocks
        return used <= before - blocks

    await eventually(freed, within=60, interval=0.2)
    await p_holds_nothing(dep)

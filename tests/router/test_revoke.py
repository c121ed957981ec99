"""`kvferry leases revoke` on a real deployment: the lease is gone, and D's blocks are
freed now (a prefill node tells D) rather than held to D's TTL."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tests.cli.test_operator_tools import BIN, run
from tests.polling import eventually
from tests.router.conftest import MakeStack, one_turn_held
from tests.router.helpers import CHAT, ask, next_turn, unheld_reads

KVFERRY = str(BIN / "kvferry")


async def test_revoke_has_a_prefill_node_free_ds_blocks(
    make_stack: MakeStack,
    http: aiohttp.ClientSession,
    reference: Callable[[str, dict[str, Any]], Awaitable[str]],
) -> None:
    stack, d, body, one, held = await one_turn_held(make_stack, http, "revoking", "revoke-me")
    [p] = stack.prefills
    code, out, err = await run(KVFERRY, "leases", "revoke", "revoke-me", "--daemon", stack.daemon.address)
    assert code == 0, err
    p_id = stack.sidecar(p).settings.node_id
    assert out.splitlines() == ["revoked", f"D's blocks released through prefill node {p_id}"]

    async def freed() -> bool:
        return held not in d.engine.snapshot()["held_requests"]

    await eventually(freed)
    [router] = stack.routers
    second = {**body, "messages": next_turn(body["messages"], one.text)}
    two = await ask(http, router.url, second)
    assert (two.decision, two.reason) == ("RECOMPUTE", "no_lease")
    assert two.text == await reference(CHAT, second)
    assert unheld_reads([*stack.prefills, *stack.decodes]) == 0


async def test_revoke_without_release_leaves_ds_blocks_held(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    stack, d, _, _, held = await one_turn_held(make_stack, http, "keeping", "keep-blocks")
    code, out, err = await run(
        KVFERRY, "leases", "revoke", "keep-blocks", "--no-release", "--json", "--daemon", stack.daemon.address
    )
    assert code == 0, err
    got = json.loads(out)
    assert got["found"] is True and got["lease"]["conversation_id"] == "keep-blocks"
    assert got["release"] == {"sent": False, "detail": "--no-release"}
    assert got["release_params"]["remote_num_tokens"] == 0  # for whoever sends them
    assert held in d.engine.snapshot()["held_requests"]

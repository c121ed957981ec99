"""D restarted between two turns of a conversation, on both backends: the retention of
the old process is never pulled from the new one (with a fixed NIXL engine id, P could
not tell the two apart and would read whatever the new process holds at those block
ids), answers are those without reuse, and no wrong KV is left in any prefix cache.

The restart is seen by the sidecar's health probes (the engine is down long enough), or
not at all (a restart inside the health window: identity, not silence, must tell)."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.helpers import first_turn, next_turn
from tests.scenarios.backends import FIXED_D_ENGINE_ID
from tests.scenarios.conftest import Deployment
from tests.scenarios.helpers import scrape
from tests.scenarios.test_conversations import reference, reused_turn

CASES = {
    # (engine id after the restart, sidecar's failed probes before it says "down")
    "fresh engine id, seen by health": (None, 3),
    "fixed engine id, inside the health window": (FIXED_D_ENGINE_ID, 100_000),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_d_restarted_between_turns_is_never_pulled_from(deployment: Deployment, case: str) -> None:
    dep = deployment
    engine_id, health_failures = CASES[case]
    await dep.stop_sidecar("decode")
    await dep.start_sidecar("decode", health_failures=health_failures)
    await dep.wait_nodes()
    conversation = dep.conversation("restarted")
    body = {"model": dep.engines.model, "max_tokens": 12, "temperature": 0}
    messages = first_turn("a decode node that restarts", size=8)
    one = await reused_turn(dep, {**body, "messages": messages, "conversation_id": conversation})

    await asyncio.to_thread(dep.engines.decode.respawn, engine_id)
    await dep.wait_routable()  # (the routers' own probes saw D down; a client meanwhile gets a 503)

    pulled = (await scrape(dep.http, dep.engines.prefill.http_url)).pulled_tokens
    second = {**body, "messages": next_turn(messages, one.text)}
    two = await reused_turn(dep, {**second, "conversation_id": conversation})
    assert two.decision != "PULL", f"pulled {two.reused} tokens of a dead process's retention"
    assert (await scrape(dep.http, dep.engines.prefill.http_url)).pulled_tokens == pulled
    assert two.text == (await reference(dep, second)).text

    # Nothing wrong was cached: a new conversation sharing the system prompt pulls and
    # answers as without reuse, on both engines' caches as they now stand. (P may still
    # hold its NIXL handshake of the old process under the fixed engine id, as vLLM does:
    # its first read then fails, the router serves that turn again without reuse, and P
    # handshakes anew.)
    await dep.wait_nodes()
    await dep.wait_routable()
    other = dep.conversation("after the restart")
    messages = first_turn("what the cache holds after a restart", size=8)
    for _ in range(3):
        turn = {**body, "messages": messages}
        got = await reused_turn(dep, {**turn, "conversation_id": other})
        assert got.text == (await reference(dep, turn)).text
        messages = next_turn(messages, got.text)
    assert got.decision == "PULL", got.reason

"""A lookup is waited for as long as the prompt's recompute time makes worth it, and a claim
answered after its turn went on without it is released, however late it comes."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.polling import eventually
from tests.router.conftest import MakeStack, Reference, Stack
from tests.router.helpers import CHAT, answers_late, ask, first_turn, next_turn


async def two_turns(
    stack: Stack, http: aiohttp.ClientSession, url: str, conversation: str, messages: list[dict[str, Any]]
) -> tuple[dict[str, Any], Any]:
    """A first turn of `conversation` whose blocks D holds; -> (the second turn's body, its answer)."""
    body = {"messages": messages, "max_tokens": 8, "conversation_id": conversation}
    one = await ask(http, url, body)
    assert one.status == 200
    await stack.registrations_idle()
    second = {**body, "messages": next_turn(body["messages"], one.text)}
    return second, await ask(http, url, second)


async def test_a_slow_lookup_still_pulls_for_a_long_prompt_and_not_for_a_short_one(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """The daemon answers 0.6 s late. A fixed 50 ms deadline gave up on every lookup and
    recomputed the whole history. Now a prompt whose recompute costs seconds (P at 2 ms a
    token, as the router measures it) waits for its answer and pulls; a short one, whose
    recompute costs less than the wait would, goes on without it."""
    stack = await make_stack(p_config={"prefill_ms_per_token": 2.0})
    # (a generous share and cap: on a loaded machine the daemon's own claim can take a second)
    router = await stack.router(
        daemon__lookup_deadline_s=0.05, daemon__lookup_recompute_share=0.5, daemon__lookup_max_wait_s=2.5
    )
    answers_late(stack.daemon, 0.6)
    long_body, long_turn = await two_turns(stack, http, router.url, "long", first_turn("long", size=80))
    assert long_turn.status == 200
    assert long_turn.decision == "PULL", long_turn.reason
    assert long_turn.reused > 1000
    assert long_turn.text == await reference(CHAT, long_body)
    short = [{"role": "user", "content": "Name three harbours, briefly."}]  # (~40 tokens)
    _, short_turn = await two_turns(stack, http, router.url, "short", short)
    assert short_turn.status == 200
    assert (short_turn.decision, short_turn.reason) == ("SKIPPED", "daemon_timeout")


async def test_a_claim_answered_after_its_turn_gave_up_is_released_however_late(
    make_stack: MakeStack, http: aiohttp.ClientSession
) -> None:
    """The daemon answers 10.5 s late: the turn went on without reuse long before, but the
    daemon had claimed the conversation's blocks on D. An answer that late was dropped
    (after 10 s) and D held the blocks to its TTL (480 s): the claim was spent for nothing.
    Now the router still has P tell D to free them."""
    stack = await make_stack()
    router = await stack.router(daemon__lookup_max_wait_s=0.2, daemon__lookup_deadline_s=0.05)
    [d] = stack.decodes
    body = {"messages": first_turn("patience"), "max_tokens": 8, "conversation_id": "too-late"}
    one = await ask(http, router.url, body)
    await stack.registrations_idle()
    [first] = d.engine.snapshot()["held_requests"]
    answers_late(stack.daemon, 10.5)
    two = await ask(http, router.url, {**body, "messages": next_turn(body["messages"], one.text)})
    assert two.status == 200 and (two.decision, two.reason) == ("SKIPPED", "daemon_timeout")

    async def released() -> bool:
        done = router.metrics.value("kvferry_router_claim_releases_total", outcome="released")
        return done == 1 and first not in d.engine.snapshot()["held_requests"]

    await eventually(released, within=20)

"""Multi-turn conversations through the router, on both backends: every turn after the
first pulls the history from D, P's own counter of pulled prompt tokens grows by what
the router says it reused, and every answer (greedy) is the one the same turn gets
without reuse."""

from __future__ import annotations

from typing import Any

from tests.router.helpers import CHAT, COMPLETIONS, Result, ask, first_turn, next_turn
from tests.scenarios.conftest import Deployment
from tests.scenarios.helpers import post_json, scrape

TURNS = 4


async def reference(dep: Deployment, body: dict[str, Any], path: str = CHAT) -> Result:
    """The same turn through the router without reuse."""
    plain = {k: v for k, v in body.items() if k != "conversation_id"}
    got = await ask(dep.http, dep.plain.url, plain, path=path)
    assert got.status == 200, got.body
    return got


async def reused_turn(dep: Deployment, body: dict[str, Any], path: str = CHAT) -> Result:
    """One turn through the reuse router, then until D's sidecar has registered it."""
    got = await ask(dep.http, dep.router.url, body, path=path)
    assert got.status == 200, got.body
    await dep.registrations_idle()
    return got


def check_reuse(turns: list[Result]) -> None:
    first, *later = turns
    assert first.decision == "RECOMPUTE", first.reason
    for n, turn in enumerate(later, 2):
        assert turn.decision == "PULL", f"turn {n}: {turn.reason}"
        assert turn.reused > 0, f"turn {n} reused nothing"


async def test_chat_conversation_pulls_and_answers_as_without_reuse(deployment: Deployment) -> None:
    dep = deployment
    conversation = dep.conversation("chat")
    before = await scrape(dep.http, dep.engines.prefill.http_url)
    messages = first_turn("the kv cache of a long agent session", size=8)
    turns: list[Result] = []
    for _ in range(TURNS):
        body = {"model": dep.engines.model, "messages": messages, "max_tokens": 16, "temperature": 0}
        got = await reused_turn(dep, {**body, "conversation_id": conversation})
        want = await reference(dep, body)
        assert got.text == want.text
        turns.append(got)
        messages = next_turn(messages, got.text)
    check_reuse(turns)
    after = await scrape(dep.http, dep.engines.prefill.http_url)
    assert after.pulled_tokens - before.pulled_tokens == sum(t.reused for t in turns)


async def test_completions_with_token_ids_pull_and_answer_as_without_reuse(deployment: Deployment) -> None:
    dep = deployment
    conversation = dep.conversation("ids")

    async def ids(text: str) -> list[int]:
        got = await post_json(dep.http, dep.engines.prefill.http_url + "/tokenize", {"prompt": text})
        return list(got["tokens"])

    before = await scrape(dep.http, dep.engines.prefill.http_url)
    prompt = await ids("Read the file and tell me about prefill and decode. " * 12)
    turns: list[Result] = []
    for n in range(TURNS):
        body = {
            "model": dep.engines.model,
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
        }
        got = await reused_turn(dep, {**body, "conversation_id": conversation}, COMPLETIONS)
        want = await reference(dep, body, COMPLETIONS)
        answer = got.body["choices"][0]["token_ids"]
        assert answer == want.body["choices"][0]["token_ids"]
        turns.append(got)
        prompt = prompt + list(answer) + await ids(f" Now turn {n}: go on and cite the file.")
    check_reuse(turns)
    after = await scrape(dep.http, dep.engines.prefill.http_url)
    assert after.pulled_tokens - before.pulled_tokens == sum(t.reused for t in turns)

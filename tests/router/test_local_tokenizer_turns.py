"""Turns through a router given tokenizer files (``--tokenizer``): with the engines' files it
tokenizes itself and every turn still pulls and answers as one engine would; with files
that are not the engines', it finds out on the node's first turn and goes back to the
engine's /tokenize; and ids that slip past the check only ever cost the reuse (the
digests differ from D's and the daemon refuses), never the answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from emulator.tokenizer_files import CHAT_TEMPLATE, write_tokenizer_files
from router import Router
from router.tokenizer import LocalTokenizer
from tests.router.conftest import MODEL, MakeStack, Reference
from tests.router.helpers import CHAT, COMPLETIONS, ask, first_turn, next_turn, pulled_tokens, unheld_reads

TOKENIZED = "kvferry_router_tokenized_total"


def files(tmp_path: Path, template: str = CHAT_TEMPLATE) -> str:
    """The emulator's tokenizer files, with `template` as their chat template."""
    out = write_tokenizer_files(tmp_path, MODEL, 32768)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return str(out)


def tokenized(router: Router) -> dict[str, float]:
    by = ("local", "engine", "compared", "differed")
    return {b: router.metrics.value(TOKENIZED, by=b) for b in by if router.metrics.value(TOKENIZED, by=b)}


async def test_a_router_with_the_engines_files_tokenizes_itself_and_every_turn_pulls(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference, tmp_path: Path
) -> None:
    stack = await make_stack()
    router = await stack.router(upstream__tokenizer=files(tmp_path))
    [p] = stack.prefills
    messages = first_turn("lighthouses")
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 30, "conversation_id": "c"}
    one = await ask(http, router.url, body)
    assert one.status == 200 and one.reason == "no_lease"
    assert tokenized(router) == {"compared": 1}  # (P's first chat turn: both ways, and they agreed)
    for turn in range(3):
        await stack.registrations_idle()
        body = {**body, "messages": next_turn(body["messages"], one.text)}
        before = pulled_tokens(p)
        one = await ask(http, router.url, body)
        assert one.status == 200 and one.decision == "PULL", dict(one.headers)
        assert pulled_tokens(p) - before == one.reused > 0
        assert one.text == await reference(CHAT, body)
        assert tokenized(router) == {"compared": 1, "local": turn + 1}
    assert router.metrics.value("kvferry_router_stage_seconds_count", stage="tokenize") == 4

    # Completions: a kind of its own, compared on its first turn too.
    prompt: dict[str, Any] = {"model": MODEL, "prompt": "Tell me about tides. " * 20, "max_tokens": 20}
    first = await ask(http, router.url, {**prompt, "session_id": "s"}, path=COMPLETIONS)
    await stack.registrations_idle()
    prompt["prompt"] += first.text + " Go on."
    second = await ask(http, router.url, {**prompt, "session_id": "s"}, path=COMPLETIONS)
    assert second.decision == "PULL" and second.text == await reference(COMPLETIONS, prompt)
    assert tokenized(router) == {"compared": 2, "local": 4}
    assert unheld_reads(stack.decodes) == 0


async def test_files_that_are_not_the_engines_are_found_out_and_left_for_the_engine(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference, tmp_path: Path
) -> None:
    stack = await make_stack()
    other = CHAT_TEMPLATE.replace("'\\n' + message['content']", "'\\n\\n' + message['content']")
    assert other != CHAT_TEMPLATE
    router = await stack.router(upstream__tokenizer=files(tmp_path, other))
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("canals"), "max_tokens": 30}
    with capture_logs() as logged:
        one = await ask(http, router.url, {**body, "conversation_id": "c"})
    assert one.status == 200
    [differs] = [e for e in logged if e["event"] == "router.tokenizer.differs"]
    assert differs["log_level"] == "warning" and differs["kind"] == "chat"
    assert differs["first_difference"] == 8  # (<|im_start|> "system" "\n", then the extra "\n")
    assert tokenized(router) == {"differed": 1}
    await stack.registrations_idle()
    body["messages"] = next_turn(body["messages"], one.text)
    two = await ask(http, router.url, {**body, "conversation_id": "c"})
    assert two.decision == "PULL" and two.text == await reference(CHAT, body)  # (the engine's ids)
    assert tokenized(router) == {"differed": 1, "engine": 1}


async def test_a_template_that_renders_a_longer_conversation_otherwise_is_found_out(
    make_stack: MakeStack, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Files that agree with the engine on a first turn (two messages) and differ from the
    first token on longer conversations: the check tokenizes the conversation's next turn
    too, and finds them out on the first."""
    stack = await make_stack()
    sly = "{% if messages | length > 2 %}X{% endif %}" + CHAT_TEMPLATE
    router = await stack.router(upstream__tokenizer=files(tmp_path, sly))
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("weirs"), "max_tokens": 5}
    with capture_logs() as logged:
        assert (await ask(http, router.url, {**body, "conversation_id": "c"})).status == 200
    [differs] = [e for e in logged if e["event"] == "router.tokenizer.differs"]
    assert differs["on"] == "next_turn" and differs["first_difference"] == 0
    assert tokenized(router) == {"differed": 1}


SLIP = "{% if messages | length > 4 %}X{% endif %}" + CHAT_TEMPLATE
"""A template that renders conversations of more than four messages unlike the engine's:
past the check (two messages, and the next turn's four), wrong from the third turn on."""


async def test_ids_that_slip_past_the_check_cost_the_reuse_never_the_answer(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference, tmp_path: Path
) -> None:
    """The digests of the third turn's ids match nothing of D's: the daemon refuses the
    reuse, and P renders the prompt itself, as always."""
    stack = await make_stack()
    router = await stack.router(upstream__tokenizer=files(tmp_path, SLIP))
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("weirs"), "max_tokens": 30}
    answer = ""
    for decision in ("RECOMPUTE", "PULL", "RECOMPUTE"):
        if answer:
            await stack.registrations_idle()
            body["messages"] = next_turn(body["messages"], answer)
        turn = await ask(http, router.url, {**body, "conversation_id": "c"})
        assert turn.status == 200 and turn.decision == decision, dict(turn.headers)
        assert turn.text == await reference(CHAT, body)
        answer = turn.text
    assert turn.reason == "prefix_mismatch"
    assert tokenized(router) == {"compared": 1, "local": 2}


async def test_a_request_the_files_cannot_render_alike_is_tokenized_by_the_engine(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference, tmp_path: Path
) -> None:
    stack = await make_stack()
    router = await stack.router(upstream__tokenizer=files(tmp_path))
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("locks"), "max_tokens": 30, "tools": tools}
    one = await ask(http, router.url, {**body, "conversation_id": "c"})
    await stack.registrations_idle()
    body["messages"] = next_turn(body["messages"], one.text)
    two = await ask(http, router.url, {**body, "conversation_id": "c"})
    assert two.decision == "PULL" and two.text == await reference(CHAT, body)
    assert tokenized(router) == {"engine": 2}  # (the template the files have renders no tools)


async def test_the_lookup_leaves_before_the_router_tokenizes(
    make_stack: MakeStack, http: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's round trip overlaps tokenizing: the Lookup is handed to gRPC before the
    local tokenizer (which waits on nothing) starts, not after the prompt is digested; and
    no prompt follows it (the router verifies the prompt against the answer itself)."""
    stack = await make_stack()
    router = await stack.router(upstream__tokenizer=files(tmp_path))
    assert router.daemon is not None
    call = router.daemon._replica.stream._call  # (opened when the router started)
    assert call is not None
    order: list[str] = []
    write, cut = call.write, LocalTokenizer.cut

    async def recorded_write(batch: Any) -> None:
        order.extend("lookup" if op.HasField("lookup") else "prompt" for op in batch.ops)
        await write(batch)

    def recorded_cut(self: LocalTokenizer, text: str, add_special_tokens: bool) -> Any:
        order.append("tokenize")
        return cut(self, text, add_special_tokens)

    body = {"model": MODEL, "messages": first_turn("sluices"), "max_tokens": 5, "conversation_id": "c"}
    assert (await ask(http, router.url, body)).status == 200  # (P's check: its /tokenize waited for)
    monkeypatch.setattr(call, "write", recorded_write)
    monkeypatch.setattr(LocalTokenizer, "cut", recorded_cut)
    assert (await ask(http, router.url, {**body, "conversation_id": "d"})).status == 200
    assert tokenized(router) == {"compared": 1, "local": 1}
    assert order == ["lookup", "tokenize"]


async def test_a_tokenizer_that_fails_leaves_the_turn_to_the_engine(
    make_stack: MakeStack, http: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = await make_stack()
    router = await stack.router(upstream__tokenizer=files(tmp_path))

    def broken(*args: Any) -> list[int]:
        raise RuntimeError("the library panicked")

    monkeypatch.setattr(LocalTokenizer, "finish", broken)
    body = {"model": MODEL, "messages": first_turn("moorings"), "max_tokens": 5, "conversation_id": "c"}
    with capture_logs() as logged:
        one = await ask(http, router.url, body)
    assert one.status == 200 and one.reason == "no_lease"
    failed = [e for e in logged if e["event"] == "router.tokenizer.failed"]
    assert failed and all("the library panicked" in e["error"] for e in failed)  # (the turn, its next)
    assert failed[0]["log_level"] == "warning"
    assert tokenized(router) == {}  # (the node's check compared nothing: it is compared again)
    with capture_logs():
        assert (await ask(http, router.url, {**body, "conversation_id": "d"})).status == 200
    assert router.metrics.value("kvferry_router_stage_seconds_count", stage="tokenize") == 2  # (by P)


async def test_the_routers_own_ids_are_never_forwarded_as_the_engines_prompt(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference, tmp_path: Path
) -> None:
    """With --forward-prompt-token-ids (engines that take them as the prompt: vLLM 0.32),
    the ids forwarded are an engine's only: the router's, unchecked after the node's first
    turn, could be wrong (here from turn 3 on), and would change the answer."""
    stack = await make_stack()
    router = await stack.router(
        upstream__tokenizer=files(tmp_path, SLIP), upstream__forward_prompt_token_ids=True
    )
    body: dict[str, Any] = {"model": MODEL, "messages": first_turn("quays"), "max_tokens": 30}
    answer = ""
    for _ in range(3):
        if answer:
            await stack.registrations_idle()
            body["messages"] = next_turn(body["messages"], answer)
        turn = await ask(http, router.url, {**body, "conversation_id": "c"})
        assert turn.status == 200 and turn.text == await reference(CHAT, body)
        answer = turn.text
    assert tokenized(router) == {"compared": 1, "local": 2}

"""Clients edit history (vLLM issue 43094: nothing in vLLM checks that P's prompt begins
with D's tokens). On both backends, a turn whose history differs from what D computed
answers exactly as it does without reuse: kvferry pulls only the blocks the prompt
really shares with D's sequence, or none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.router.helpers import SYSTEM, first_turn, next_turn
from tests.scenarios.conftest import Deployment
from tests.scenarios.test_conversations import reference, reused_turn

Messages = list[dict[str, Any]]


def trimmed(history: Messages) -> Messages:
    """The last answer cut short (a client that stripped its tail)."""
    out = [dict(m) for m in history]
    answer = out[-2]
    answer["content"] = answer["content"][: len(answer["content"]) // 2]
    return out


def emptied(history: Messages) -> Messages:
    out = [dict(m) for m in history]
    out[-2]["content"] = ""
    return out


def one_byte_changed(history: Messages) -> Messages:
    """One character of the first user message changed (early in D's sequence)."""
    out = [dict(m) for m in history]
    text = out[1]["content"]
    out[1]["content"] = text[:40] + ("X" if text[40] != "X" else "Y") + text[41:]
    return out


def first_messages_dropped(history: Messages) -> Messages:
    return [dict(m) for m in history[2:]]


def system_inserted(history: Messages) -> Messages:
    return [{"role": "system", "content": "Answer briefly. " * 10}, *(dict(m) for m in history)]


EDITS: dict[str, Callable[[Messages], Messages]] = {
    "last answer trimmed": trimmed,
    "last answer emptied": emptied,
    "one byte changed": one_byte_changed,
    "first messages dropped": first_messages_dropped,
    "system prompt inserted": system_inserted,
}


@pytest.mark.parametrize("edit", list(EDITS))
async def test_an_edited_history_answers_as_without_reuse(deployment: Deployment, edit: str) -> None:
    dep = deployment
    conversation = dep.conversation("edited")
    messages = first_turn(f"an edited history ({edit})", size=8)
    assert messages[0] == SYSTEM
    body: dict[str, Any] = {"model": dep.engines.model, "max_tokens": 12, "temperature": 0}
    one = await reused_turn(dep, {**body, "messages": messages, "conversation_id": conversation})
    second = {**body, "messages": EDITS[edit](next_turn(messages, one.text))}
    two = await reused_turn(dep, {**second, "conversation_id": conversation})
    want = await reference(dep, second)
    assert two.text == want.text, f"{two.decision} {two.reason}: reused {two.reused}"

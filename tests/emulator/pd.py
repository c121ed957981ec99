"""A prefill/decode turn as the router drives it (P prefills, D pulls and decodes), the
first turn the P/D flow tests start from, and checks of what an engine still holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from emulator import EmulatorServer
from tests.conftest import StartEmulator
from tests.emulator.helpers import Answer, Client, conversation
from tests.polling import eventually


async def pd_turn(
    http: Client,
    p: EmulatorServer,
    d: EmulatorServer,
    messages: list[dict[str, Any]],
    pull_from: dict[str, Any] | None = None,
) -> tuple[Answer, Answer]:
    """One P/D turn; returns P's and D's answers."""
    prefill = await http.prefill(p, messages, pull_from)
    assert prefill.status == 200, prefill.body
    assert prefill.params is not None and prefill.params["do_remote_prefill"] is True
    decode = await http.chat(d, messages, max_tokens=64, kv_transfer_params=prefill.params)
    assert decode.status == 200, decode.body
    return prefill, decode


def next_turn(messages: list[dict[str, Any]], answer: str, text: str = "Go on. ") -> list[dict[str, Any]]:
    """`messages`, then `answer` as the assistant's and `text` (four times) as the user's."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": text * 4}]


@dataclass
class FirstTurn:
    """A first turn done through P (no prefix cache) and D: D holds its blocks for the next."""

    p: EmulatorServer
    d: EmulatorServer
    first: list[dict[str, Any]]
    """The first turn's messages."""
    decode: Answer
    """D's answer to it."""
    params: dict[str, Any]
    """D's params of its blocks (`decode.params`)."""
    second: list[dict[str, Any]]
    """The next turn's messages (after D's answer)."""


async def run_first_turn(start_emulator: StartEmulator, http: Client) -> FirstTurn:
    """Start P (no prefix cache) and D, and run a first turn of `conversation()` through them."""
    p = await start_emulator(enable_prefix_caching=False)
    d = await start_emulator()
    first = conversation()
    _, decode = await pd_turn(http, p, d, first)
    params = decode.params
    assert params is not None
    return FirstTurn(p, d, first, decode, params, next_turn(first, decode.content))


async def fully_free(http: Client, emu: EmulatorServer) -> bool:
    """Whether `emu` holds no request's blocks and has every block free."""
    state = await http.state(emu)
    return not state["held_requests"] and state["free_blocks"] == state["num_blocks"]


async def not_held(http: Client, emu: EmulatorServer, request_id: str) -> bool:
    """Whether `emu` no longer holds the blocks of `request_id`."""
    return request_id not in (await http.state(emu))["held_requests"]


async def wait_until_free(http: Client, emu: EmulatorServer) -> bool:
    """Wait (15 s at most) until `emu` is fully free."""
    await eventually(lambda: fully_free(http, emu), within=15)
    return True


async def reference_answer(start: StartEmulator, http: Client, messages: list[dict[str, Any]]) -> str:
    """The answer of a fresh engine that computes everything itself."""
    alone = await start()
    answer = await http.chat(alone, messages, max_tokens=64)
    assert answer.pull == "none"
    assert answer.count("computed") == answer.body["usage"]["prompt_tokens"]
    return answer.content

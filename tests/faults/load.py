"""The client load of the fault suite: clients each running multi-turn conversations
through the router, one after another, all the time; every turn's answer checked
against the reference engine's answer to the same messages."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MODEL = "kvferry/emulated-model"
MAX_TOKENS = 24
_WORDS = (
    *("def", "class", "return", "import", "self", "config", "value", "error", "None", "True"),
    *("request", "block", "token", "cache", "node", "lease", "prefix", "decode", "prefill"),
)


@dataclass
class Turn:
    """One client turn as the client saw it."""

    conversation: str
    turn: int
    started: float
    ended: float
    status: int
    decision: str = ""
    reason: str = ""
    reused_tokens: int = 0
    answer: str = ""
    correct: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.correct


@dataclass
class Load:
    """`clients` clients, each running `turns`-turn conversations until `stop()`."""

    router_url: str
    reference_url: str
    clients: int = 3
    turns: int = 8
    think_s: float = 0.05
    seed: int = 1
    turns_done: list[Turn] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _http: aiohttp.ClientSession | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._tasks = [asyncio.create_task(self._client(i), name=f"client-{i}") for i in range(self.clients)]

    async def stop(self) -> None:
        """Let every client finish its turn in flight, then stop."""
        self._stop.set()
        try:
            await asyncio.gather(*self._tasks)
        finally:
            if self._http is not None:
                await self._http.close()

    async def until(self, condition: Callable[[list[Turn]], bool], timeout_s: float) -> None:
        """Until `condition(turns so far)` holds (TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(timeout_s):
            while not condition(self.turns_done):
                for t in self._tasks:
                    if t.done():
                        t.result()  # (a client that crashed: its error, not a timeout)
                self._changed.clear()
                await self._changed.wait()

    async def pulls_after(self, t0: float, count: int, timeout_s: float = 60.0) -> None:
        """Until `count` turns started after `t0` pulled."""
        await self.until(
            lambda ts: sum(t.started > t0 and t.decision == "PULL" for t in ts) >= count, timeout_s
        )

    async def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        n = 0
        while not self._stop.is_set():
            messages = [
                {"role": "system", "content": "You are a coding agent.\n" + _text(rng, 600)},
                {"role": "user", "content": f"Task {index}-{n}: fix it.\n" + _text(rng, 200)},
            ]
            cid = f"client{index}-conv{n}"
            for t in range(self.turns):
                if self._stop.is_set():
                    return
                turn = await self._turn(cid, t, messages)
                self.turns_done.append(turn)
                self._changed.set()
                messages += [
                    {"role": "assistant", "content": turn.answer},
                    {"role": "user", "content": f"$ cat file_{t}.py\n" + _text(rng, rng.randint(200, 500))},
                ]
                await asyncio.sleep(self.think_s)
            n += 1

    async def _turn(self, cid: str, t: int, messages: list[dict[str, str]]) -> Turn:
        assert self._http is not None
        turn = Turn(cid, t, time.monotonic(), 0.0, 0)
        try:
            await _stream_turn(self._http, self.router_url, cid, messages, turn)
            if turn.status == 200:
                turn.correct = turn.answer == await _reference(self._http, self.reference_url, messages)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            turn.error = repr(e)
        turn.ended = time.monotonic()
        return turn


async def _stream_turn(
    http: aiohttp.ClientSession, url: str, cid: str, messages: list[dict[str, str]], turn: Turn
) -> None:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "conversation_id": cid,
    }
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        turn.status = r.status
        if r.status != 200:
            turn.error = (await r.text())[:300]
            return
        turn.decision = r.headers.get("X-Kvferry-Reuse", "")
        turn.reason = r.headers.get("X-Kvferry-Reuse-Reason", "")
        turn.reused_tokens = int(r.headers.get("X-Kvferry-Reused-Tokens", "0"))
        text: list[str] = []
        done = False
        async for raw in r.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    turn.error = json.dumps(event)[:300]
                for choice in event.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
        turn.answer = "".join(text)
        if not done and not turn.error:
            turn.error = "stream ended without [DONE]"
        if turn.error:
            turn.status = -1


async def _reference(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        got: dict[str, Any] = await r.json()
        assert r.status == 200, got
        return str(got["choices"][0]["message"]["content"])


def _text(rng: random.Random, chars: int) -> str:
    lines, size = [], 0
    while size < chars:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]

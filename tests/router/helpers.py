"""A client of the router for the tests: one turn, streamed or not, decoded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from controlplane.daemon import Daemon
from emulator import EmulatorServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SYSTEM = {"role": "system", "content": "You are a careful assistant who reads every file. " * 6}


@dataclass
class Result:
    status: int
    headers: Mapping[str, str]
    body: dict[str, Any] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)
    text: str = ""

    @property
    def decision(self) -> str:
        return self.headers.get("X-Kvferry-Reuse", "")

    @property
    def reason(self) -> str:
        return self.headers.get("X-Kvferry-Reuse-Reason", "")

    @property
    def reused(self) -> int:
        return int(self.headers.get("X-Kvferry-Reused-Tokens", "0"))


async def ask(
    http: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    headers: Mapping[str, str] | None = None,
    path: str = CHAT,
) -> Result:
    """One request; collects the answer text of a stream or a JSON answer."""
    async with http.post(base_url + path, json=body, headers=headers) as r:
        if r.status != 200 or not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            raw = await r.read()
            obj = json.loads(raw) if raw else {}
            res = Result(r.status, r.headers, body=obj)
            if r.status == 200:
                choice = obj["choices"][0]
                res.text = choice["message"]["content"] if "message" in choice else choice["text"]
            return res
        res = Result(r.status, r.headers)
        async for raw_line in r.content:
            line = raw_line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            event = data if data == "[DONE]" else json.loads(data)
            res.events.append(event)
            if isinstance(event, dict) and event.get("choices"):
                choice = event["choices"][0]
                res.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        return res


def first_turn(topic: str, size: int = 4) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": f"Tell me about {topic}. " * size}]


def next_turn(
    messages: list[dict[str, Any]], answer: str, text: str = "Go on, and cite the file. "
) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": text * 3}]


def unheld_reads(engines: list[EmulatorServer]) -> float:
    """Reads of blocks no longer (or never) held for the request named, on these engines: a
    stale or wrong handout, which the engines serve silently with whatever KV is there (as
    vLLM does). A correct control plane makes none."""
    return sum(e.engine.metrics.total("kvferry_emulator:kv_reads_unheld") for e in engines)


def pulled_tokens(emu: EmulatorServer) -> float:
    """Tokens an engine pulled from remote engines so far."""
    return emu.engine.metrics.total("kvferry_emulator:kv_pulled_tokens")


async def tokenize(
    http: aiohttp.ClientSession, emu: EmulatorServer, messages: list[dict[str, Any]]
) -> list[int]:
    async with http.post(emu.http_url + "/tokenize", json={"messages": messages}) as r:
        assert r.status == 200
        return list((await r.json())["tokens"])


def answers_late(daemon: Daemon, delay_s: float) -> None:
    """The daemon claims and decides as ever, then answers lookups `delay_s` late (busy,
    or starved of CPU by the engines beside it)."""
    assert daemon.control_plane is not None
    cp = daemon.control_plane.lookups
    lookup = cp.lookup

    async def late(*args: Any, **kwargs: Any) -> Any:
        result = await lookup(*args, **kwargs)
        await asyncio.sleep(delay_s)
        return result

    cp.lookup = late  # type: ignore[method-assign]
    cp.lookup_now = lambda q: None  # type: ignore[method-assign]  # (every lookup the awaited way)

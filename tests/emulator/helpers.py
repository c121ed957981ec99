"""Helpers for the emulator tests: bounded async tests, configs, an HTTP client."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import pytest

from emulator import EmulatorConfig, EmulatorServer

F = TypeVar("F", bound=Callable[..., Awaitable[None]])

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 8}


def async_test(timeout: float = 10.0) -> Callable[[F], F]:
    """Mark a coroutine test for pytest-asyncio and bound it with a timeout."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> None:
            async with asyncio.timeout(timeout):
                await fn(*args, **kwargs)

        return pytest.mark.asyncio(run)  # type: ignore[no-any-return]

    return wrap


def config(**changes: Any) -> EmulatorConfig:
    """A loopback config with every port picked at runtime and no simulated delays."""
    base = EmulatorConfig(
        host="127.0.0.1",
        port=0,
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        kv_events_host="127.0.0.1",
    )
    return base.replace(**changes)


@dataclass
class Answer:
    """One HTTP answer, decoded."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str]

    @property
    def params(self) -> dict[str, Any] | None:
        value = self.body.get("kv_transfer_params")
        return value if isinstance(value, dict) else None

    @property
    def content(self) -> str:
        return str(self.body["choices"][0]["message"]["content"])

    @property
    def pull(self) -> str:
        return self.headers["X-Kvferry-Emulator-Pull"]

    def count(self, what: str) -> int:
        """``cached``, ``pulled`` or ``computed`` tokens of the prefill."""
        return int(self.headers[f"X-Kvferry-Emulator-{what.capitalize()}-Tokens"])


class Client:
    """Talks to emulators over real HTTP."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def post(self, emu: EmulatorServer, path: str, body: Mapping[str, Any]) -> Answer:
        async with self.session.post(emu.http_url + path, json=body) as response:
            return Answer(response.status, await response.json(), response.headers)

    async def chat(self, emu: EmulatorServer, messages: list[dict[str, Any]], **fields: Any) -> Answer:
        return await self.post(emu, "/v1/chat/completions", {"messages": messages, **fields})

    async def prefill(
        self, emu: EmulatorServer, messages: list[dict[str, Any]], params: Mapping[str, Any] | None = None
    ) -> Answer:
        """Ask a prefiller like the router does: max_tokens=1, do_remote_decode."""
        kv = dict(params) if params else {"do_remote_decode": True, "do_remote_prefill": False}
        kv["do_remote_decode"] = True
        kv["do_remote_prefill"] = False
        return await self.chat(emu, messages, max_tokens=1, kv_transfer_params=kv)

    async def state(self, emu: EmulatorServer) -> dict[str, Any]:
        async with self.session.get(emu.http_url + "/emulator/state") as response:
            assert response.status == 200
            return dict(await response.json())

    async def stream(self, emu: EmulatorServer, path: str, body: Mapping[str, Any]) -> list[Any]:
        """Every SSE ``data:`` payload of a streamed answer (``[DONE]`` kept as a string)."""
        events: list[Any] = []
        async with self.session.post(emu.http_url + path, json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line:
                    continue
                assert line.startswith("data: ")
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
        return events


def conversation(turns: int = 1) -> list[dict[str, Any]]:
    """A first-turn conversation long enough for pulls above the default threshold."""
    return [SYSTEM, {"role": "user", "content": "Tell me about ferries and harbours. " * 6}][: 1 + turns]

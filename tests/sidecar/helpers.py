"""HTTP helpers of the sidecar tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from kvferry.structs import struct_to_dict
from tests.emulator.helpers import SYSTEM, Answer


async def chat(
    http: aiohttp.ClientSession,
    base_url: str,
    messages: list[dict[str, Any]],
    headers: Mapping[str, str] | None = None,
    **fields: Any,
) -> Answer:
    async with http.post(
        base_url + "/v1/chat/completions", json={"messages": messages, **fields}, headers=headers
    ) as r:
        return Answer(r.status, await r.json(), r.headers)


async def prefill(
    http: aiohttp.ClientSession,
    base_url: str,
    messages: list[dict[str, Any]],
    params: Mapping[str, Any] | None = None,
) -> Answer:
    """Ask a prefill node like the router does: max_tokens=1, do_remote_decode."""
    kv = dict(params) if params else {}
    kv["do_remote_decode"] = True
    kv["do_remote_prefill"] = False
    return await chat(http, base_url, messages, max_tokens=1, kv_transfer_params=kv)


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def tokenize(http: aiohttp.ClientSession, base_url: str, messages: list[dict[str, Any]]) -> list[int]:
    async with http.post(base_url + "/tokenize", json={"messages": messages}) as r:
        assert r.status == 200
        return list((await r.json())["tokens"])


def next_turn(messages: list[dict[str, Any]], answer: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on. " * 4}]


def first_turn(topic: str = "ferries and harbours") -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": f"Tell me about {topic}. " * 6}]


def params_of(struct: Any) -> dict[str, Any]:
    return struct_to_dict(struct)


class FakePublisher:
    """A KV-event publisher speaking vLLM's ZMQ protocol, whose messages a test controls.

    `publish` sends ``[topic, seq, payload]`` on PUB (unless ``deliver=False``: the
    message is lost on the way, but kept for replay, like a slow joiner or a
    dropped message); the ROUTER answers replays from the kept messages, in vLLM
    0.32's shape (``[topic, seq, payload]`` ... ``[b"", -1, b""]``), or with
    ``legacy_replay`` in older releases' and SGLang's (``[seq, payload]`` ... ``[-1, b""]``).
    """

    def __init__(self, topic: bytes = b"", legacy_replay: bool = False) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.kept: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self.replay_pace_s = 0.0
        """A pause before each replayed message (a long replay)."""
        self.legacy_replay = legacy_replay
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._serve_replays())

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            self.replays.append(first)
            topic = [] if self.legacy_replay else [self.topic]
            for seq, payload in list(self.kept):
                if seq >= first:
                    await asyncio.sleep(self.replay_pace_s)
                    await self.router.send_multipart(
                        [client, b"", *topic, seq.to_bytes(8, "big", signed=True), payload]
                    )
            end = [] if self.legacy_replay else [b""]
            await self.router.send_multipart([client, b"", *end, (-1).to_bytes(8, "big", signed=True), b""])

    async def publish(self, seq: int, payload: bytes, deliver: bool = True) -> None:
        self.kept.append((seq, payload))
        if deliver:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big", signed=True), payload])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()

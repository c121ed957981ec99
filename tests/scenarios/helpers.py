"""What the scenarios read off the engines, as an operator would: their /metrics
(`realvllm.metrics`), their tokenizer, their KV-event stream. Nothing here knows which
backend runs."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from realvllm.metrics import Metrics, scrape

__all__ = ["KvReference", "Metrics", "post_json", "scrape"]


async def post_json(
    http: aiohttp.ClientSession, url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    async with http.post(url, json=body, headers=headers) as r:
        got = await r.json(content_type=None)
        assert r.status == 200, got
        return dict(got)


class KvReference:
    """What an engine's prefix cache holds, by its own account: every KV-event batch from
    seq 0 of the current engine process, read from the replay endpoint. Independent of the
    sidecar's decoder: msgspec on the wire format vLLM documents."""

    def __init__(self, replay_endpoint: str) -> None:
        self.replay_endpoint = replay_endpoint

    async def blocks(self, timeout_s: float = 10.0) -> set[int]:
        held: set[int] = set()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", struct.pack(">q", 0)])
            async with asyncio.timeout(timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    payload = frames[-1]
                    seq = struct.unpack(">q", frames[-2])[0]
                    if seq == -1:
                        return held
                    _, events, *_ = msgspec.msgpack.decode(payload)
                    for event in events:
                        _apply(held, event)
        finally:
            sock.close(linger=0)
            ctx.term()


def _hash(value: Any) -> int:
    if isinstance(value, bytes):  # a raw digest: its low 64 bits, as vLLM's int form
        return int.from_bytes(value[-8:], "big")
    return int(value) & 0xFFFFFFFFFFFFFFFF


def _apply(held: set[int], event: Mapping[str, Any]) -> None:
    # Events are msgpack maps tagged by "type" (vLLM's KVCacheEvent: tag=True, not array-like).
    kind = event.get("type")
    if kind == "BlockStored":
        held.update(_hash(h) for h in event["block_hashes"])
    elif kind == "BlockRemoved":
        held.difference_update(_hash(h) for h in event["block_hashes"])
    elif kind == "AllBlocksCleared":
        held.clear()

"""Blocks an engine holds for a remote reader, as NIXL's sending side does.

A prefiller holds a request's blocks for its decoder (``kv_abort_timeout``), a
decoder with bidirectional transfer holds a finished request's blocks for the
next turn's prefiller (``decoder_kv_blocks_ttl``). The reader pulls them over
the side channel and then notifies; the notify (or the deadline, whichever
comes first) frees them. After that the request is unknown: a second read of
the same params fails, as a stale read on a real engine would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import structlog

from emulator.blocks import Block
from emulator.sidechannel import Notify, ReadBlocks, SideChannelError

log = structlog.get_logger(__name__)

_kv_of = attrgetter("kv")

#: Bumped when an engine re-registers its KV memory; never, in the emulator.
REGISTRATION_GENERATION = 0


@dataclass(eq=False)
class _Hold:
    blocks: list[Block]
    expiry_time: float
    timer: asyncio.TimerHandle
    by_id: dict[int, Block] = field(init=False)

    def __post_init__(self) -> None:
        self.by_id = {block.block_id: block for block in self.blocks}


class HeldBlockTable:
    """Held blocks by request id; answers the side channel's reads and notifies."""

    def __init__(self, engine_id: str, free: Callable[[list[Block]], None]) -> None:
        self._engine_id = engine_id
        self._free = free
        self._holds: dict[str, _Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, request_id: str, blocks: list[Block], ttl: float) -> float:
        """Keep blocks for ``ttl`` seconds; returns the ``time.perf_counter()`` deadline."""
        expiry = time.perf_counter() + ttl
        timer = asyncio.get_running_loop().call_later(ttl, self._expire, request_id)
        self._holds[request_id] = _Hold(blocks, expiry, timer)
        log.info("engine.blocks.held", request_id=request_id, blocks=len(blocks), ttl=ttl)
        return expiry

    def _expire(self, request_id: str) -> None:
        hold = self._holds.pop(request_id, None)
        if hold is not None:
            log.info("engine.blocks.expired", request_id=request_id)
            self._free(hold.blocks)

    def _checked(self, engine_id: str, request_id: str) -> _Hold:
        if engine_id != self._engine_id:
            raise SideChannelError(f"unknown engine {engine_id!r}")
        hold = self._holds.get(request_id)
        if hold is None:
            raise SideChannelError(f"unknown request {request_id!r}")
        return hold

    def read_blocks(self, request: ReadBlocks) -> bytes:
        """KV of blocks held for a request, concatenated in the order asked for (a copy)."""
        hold = self._checked(request.engine_id, request.request_id)
        generation = request.registration_generation
        if generation is not None and generation != REGISTRATION_GENERATION:
            raise SideChannelError(f"stale registration generation {generation}")
        try:
            return b"".join(map(_kv_of, map(hold.by_id.__getitem__, request.block_ids)))
        except KeyError:
            missing = [b for b in request.block_ids if b not in hold.by_id]
            raise SideChannelError(f"blocks {missing} are not held for this request") from None

    def release_blocks(self, request: Notify) -> None:
        """The reader is done: free the request's blocks."""
        self._checked(request.engine_id, request.request_id)
        hold = self._holds.pop(request.request_id)
        hold.timer.cancel()
        log.info("engine.blocks.released", request_id=request.request_id)
        self._free(hold.blocks)

    def close(self) -> None:
        """Cancel the deadlines (the engine is going away)."""
        for hold in self._holds.values():
            hold.timer.cancel()
        self._holds.clear()

    def snapshot(self) -> dict[str, Any]:
        """Held request ids with their block ids and seconds left."""
        now = time.perf_counter()
        return {
            rid: {"blocks": [b.block_id for b in hold.blocks], "expires_in": hold.expiry_time - now}
            for rid, hold in self._holds.items()
        }

"""Blocks an engine holds for a remote reader, as NIXL's sending side does.

A prefiller holds a request's blocks for its decoder (``kv_abort_timeout``), a
decoder with bidirectional transfer holds a finished request's blocks for the
next turn's prefiller (``decoder_kv_blocks_ttl``). The reader pulls them over
the side channel and then notifies; the notify (or the deadline, whichever
comes first) frees them.

A read is a NIXL read of registered KV memory: nothing checks that the blocks are
still held for the request. A second read of the same params, or one after the
deadline, returns whatever the blocks hold by then: the same KV until they are
reused, another request's after. So a stale handout gives the reader wrong KV
silently, as on vLLM (whose notify for an unknown request only logs "Potentially
invalid KV blocks for unrecognized request"). Such reads are logged and counted:
`unheld_reads`, the emulator's way to tell a test that a control plane erred.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import structlog

from emulator.blocks import Block
from emulator.sidechannel import Handshake, Notify, ReadBlocks, SideChannelError

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

    def __init__(
        self,
        engine_id: str,
        free: Callable[[list[Block]], None],
        memory: Sequence[Block],
        on_unheld_read: Callable[[], None] = lambda: None,
        agent: str = "",
    ) -> None:
        self._engine_id = engine_id
        self.agent = agent
        """This process's agent (vLLM: its NIXL agent's name, a uuid4 per process)."""
        self._free = free
        self._memory = memory  # every block of the engine, by block id: what a reader can reach
        self._on_unheld_read = on_unheld_read
        self._holds: dict[str, _Hold] = {}
        self.unheld_reads = 0
        """Reads of blocks not held for the request named (a stale or wrong handout)."""

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

    def _check_engine(self, engine_id: str, agent: str = "") -> None:
        if engine_id != self._engine_id:  # another agent's memory: the transfer cannot start
            raise SideChannelError(f"unknown engine {engine_id!r}")
        if agent and agent != self.agent:  # a handshake of a process that is gone
            raise SideChannelError(f"unknown agent {agent!r}: its process is gone")

    def handshake(self, request: Handshake) -> str:
        """This process's agent, for a puller expecting engine `request.engine_id`."""
        if request.engine_id != self._engine_id:  # (vLLM: "Remote NIXL agent engine ID mismatch")
            raise SideChannelError(f"engine id mismatch: {request.engine_id!r} expected, this is another")
        return self.agent

    def read_blocks(self, request: ReadBlocks) -> bytes:
        """KV of the blocks asked for, concatenated in that order (a copy), held or not."""
        self._check_engine(request.engine_id, request.agent)
        generation = request.registration_generation
        if generation is not None and generation != REGISTRATION_GENERATION:
            raise SideChannelError(f"stale registration generation {generation}")
        ids = request.block_ids
        size = len(self._memory)
        if ids and (min(ids) < 0 or max(ids) >= size):  # C-level passes; the list only for the message
            outside = [b for b in ids if not 0 <= b < size]
            raise SideChannelError(f"blocks {outside} are outside the registered KV memory")
        hold = self._holds.get(request.request_id)
        if hold is None or not all(map(hold.by_id.__contains__, ids)):
            self.unheld_reads += 1
            self._on_unheld_read()
            log.warning(
                "engine.blocks.read_unheld",
                request_id=request.request_id,
                request_known=hold is not None,
                blocks=len(ids),
            )
        return b"".join(map(_kv_of, map(self._memory.__getitem__, ids)))

    def release_blocks(self, request: Notify) -> None:
        """The reader is done: free the request's blocks (an unknown request: logged only)."""
        self._check_engine(request.engine_id, request.agent)
        hold = self._holds.pop(request.request_id, None)
        if hold is None:
            log.error(
                "engine.blocks.release_unknown",
                request_id=request.request_id,
                detail="Potentially invalid KV blocks for unrecognized request (they may have expired)",
            )
            return
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

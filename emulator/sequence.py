"""One request inside the emulated engine: what was asked, and the KV that answers it.

A ``GenerationSpec`` is the request as the engine takes it; ``PrefillStats`` say where its
prompt's KV came from; a ``KVSequence`` is its tokens, the blocks holding their KV and
the prefix-cache hashes of those blocks. The sequence reads and writes its KV slots
(``kvmodel`` says what a slot holds); the engine decides when.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from emulator import kvmodel
from emulator.blocks import Block


@dataclass(frozen=True)
class GenerationSpec:
    """One request as the engine sees it, after templating and validation."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    kv_transfer_params: Mapping[str, Any] | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    """The request's own prefix cache (vLLM's cache_salt): it hits only blocks of its salt."""


@dataclass
class PrefillStats:
    """Where the prompt's KV came from."""

    prompt_tokens: int
    local_cached_tokens: int = 0
    pulled_tokens: int = 0
    pulled_blocks: int = 0
    computed_tokens: int = 0
    pull: str = "none"
    """``none``, ``pulled``, ``skipped:<reason>``, ``failed:<reason>`` or ``recomputed:<reason>``."""


@dataclass(eq=False)
class KVSequence:
    """A request's tokens (prompt, then generated) and the KV blocks that hold them."""

    token_ids: list[int]
    block_size: int
    blocks: list[Block] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    """Hashes of the blocks entered into the prefix cache (committed)."""
    prompt_hashes: list[bytes] = field(default_factory=list)
    """Hashes of the prompt's full blocks, computed once at admission and reused at commit."""
    session_id: str | None = None
    first_state: bytes | None = None
    """Sampler state for the first token, set by the prefill."""

    def slot(self, position: int) -> bytes:
        """The KV of ``position`` (``GENESIS_KV`` before the first)."""
        if position < 0:
            return kvmodel.GENESIS_KV
        block, offset = divmod(position, self.block_size)
        start = offset * kvmodel.SLOT_BYTES
        return bytes(self.blocks[block].kv[start : start + kvmodel.SLOT_BYTES])

    def write_kv(self, position: int) -> bytes:
        """Compute and write the KV of the token at ``position``; return it."""
        kv = kvmodel.token_kv(self.slot(position - 1), position, self.token_ids[position])
        block, offset = divmod(position, self.block_size)
        start = offset * kvmodel.SLOT_BYTES
        self.blocks[block].kv[start : start + kvmodel.SLOT_BYTES] = kv
        return kv

    def write_prompt_kv(self, start: int, stop: int) -> None:
        """Compute the KV of positions ``start .. stop - 1`` and write it block by block."""
        kv = kvmodel.chain_kv(self.slot(start - 1), start, self.token_ids[start:stop])
        view = memoryview(kv)
        bs, slot_bytes = self.block_size, kvmodel.SLOT_BYTES
        position = start
        while position < stop:
            block, offset = divmod(position, bs)
            count = min(bs - offset, stop - position)
            done = (position - start) * slot_bytes
            self.blocks[block].kv[offset * slot_bytes : (offset + count) * slot_bytes] = view[
                done : done + count * slot_bytes
            ]
            position += count

    def context_state(self) -> bytes:
        """Sampler state over every KV slot of the computed context."""
        full, rest = divmod(self.num_computed, self.block_size)
        slots: list[bytearray | memoryview] = [block.kv for block in self.blocks[:full]]
        if rest:
            slots.append(memoryview(self.blocks[full].kv)[: rest * kvmodel.SLOT_BYTES])
        return kvmodel.context_state(slots)

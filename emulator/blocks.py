"""KV block pool with vLLM-style prefix caching, ref counts and LRU eviction.

Blocks whose ref count drops to 0 join the tail of a free queue but keep their
hash, so a later request can still hit them; allocation takes blocks from the
head of the queue (least recently freed first) and evicts their hash then,
publishing ``BlockRemoved``. Blocks are freed tail-first, so a sequence's last
blocks are evicted before its prefix. Pinned blocks (ref count > 0: running
requests, blocks held for a remote reader) are never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

from emulator.kvevents import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)
from emulator.kvmodel import SLOT_BYTES
from kvferry.blockhash import external_block_hash


class NoFreeBlocks(RuntimeError):
    """Fewer free blocks than asked for."""


@dataclass(eq=False)
class Block:
    """One KV block: ``block_size`` slots of KV, a ref count and its cache hash."""

    block_id: int
    kv: bytearray
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)


class BlockPool:
    """A fixed number of KV blocks shared by all requests of one engine."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        emit: Callable[[Event], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [
            Block(block_id=i, kv=bytearray(block_size * SLOT_BYTES)) for i in range(num_blocks + 1)
        ]
        """Every block, by block id: block 0, vLLM's null block (never allocated; what a
        sliding-window group's freed positions point at, so no request's params name it),
        then the `num_blocks` a request can have."""
        self._free: OrderedDict[int, Block] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self._cached: dict[bytes, dict[int, Block]] = {}
        self._emit = emit if enable_caching else None

    @property
    def num_blocks(self) -> int:
        """Capacity of the pool (the null block aside)."""
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated (free, possibly still cached)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a prefix-cache hash."""
        return sum(len(entries) for entries in self._cached.values())

    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - self.num_free / self.num_blocks

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether some block carries this hash."""
        return bool(self._cached.get(block_hash))

    def find_cached_prefix(self, hashes: Sequence[bytes]) -> list[Block]:
        """Cached blocks of the longest prefix of ``hashes`` (stops at the first miss)."""
        if not self.enable_caching:
            return []
        hits: list[Block] = []
        append = hits.append
        for entries in map(self._cached.get, hashes):
            if not entries:
                break
            append(next(iter(entries.values())))
        return hits

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks (a cache hit); pinned blocks leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks from the head of the free queue, evicting their hashes."""
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        taken: list[Block] = []
        pop = self._free.popitem
        for _ in range(count):
            _, block = pop(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        entries = self._cached.get(block.block_hash)
        if entries is not None:
            entries.pop(block.block_id, None)
            if not entries:
                del self._cached[block.block_hash]
        removed = block.block_hash
        block.block_hash = None
        block.token_ids = []
        if self._emit is not None:
            self._emit(BlockRemoved(block_hashes=[external_block_hash(removed)], medium=MEDIUM_GPU))

    def cache_blocks(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[bytes],
        token_ids: Sequence[Sequence[int]],
        *,
        parent: bytes | None,
        session_id: str | None = None,
    ) -> None:
        """Enter newly full blocks into the prefix cache and publish ``BlockStored``.

        ``parent`` is the hash of the block before ``blocks[0]`` (None at the
        start of a sequence); blocks that are already cached are skipped.
        """
        if not self.enable_caching:
            return
        runs: list[tuple[bytes | None, list[Block]]] = []
        previous = parent
        run_open = False
        for block, block_hash, tokens in zip(blocks, hashes, token_ids, strict=True):
            if block.block_hash is None:
                block.block_hash = block_hash
                block.token_ids = list(tokens)
                self._cached.setdefault(block_hash, {})[block.block_id] = block
                if not run_open:
                    runs.append((previous, []))
                    run_open = True
                runs[-1][1].append(block)
            else:
                run_open = False
            previous = block_hash
        if self._emit is None:
            return
        for run_parent, run in runs:
            self._emit(
                BlockStored(
                    block_hashes=[external_block_hash(_hash_of(b)) for b in run],
                    parent_block_hash=(None if run_parent is None else external_block_hash(run_parent)),
                    token_ids=list(chain.from_iterable(b.token_ids for b in run)),
                    block_size=self.block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    session_id=session_id,
                )
            )

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop a reference on blocks, tail first; unreferenced ones become evictable."""
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = []
        self._cached.clear()
        if self._emit is not None:
            self._emit(AllBlocksCleared())
        return True


def _hash_of(block: Block) -> bytes:
    if block.block_hash is None:
        raise RuntimeError(f"block {block.block_id} has no hash")
    return block.block_hash

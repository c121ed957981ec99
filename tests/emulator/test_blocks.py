"""Block pool: prefix hits, ref counts, LRU eviction, pinned blocks, events."""

from __future__ import annotations

import pytest

from emulator.blocks import Block, BlockPool, NoFreeBlocks
from emulator.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvferry.blockhash import block_hashes, external_block_hash

BS = 4


def _pool(num_blocks: int = 4) -> tuple[BlockPool, list[Event]]:
    events: list[Event] = []
    return BlockPool(num_blocks, BS, enable_caching=True, emit=events.append), events


def _store(pool: BlockPool, tokens: list[int], session_id: str | None = None) -> list[Block]:
    """Allocate and cache blocks for full blocks of tokens, as a finished prefill does."""
    hashes = block_hashes(tokens, BS)
    blocks = pool.allocate(len(hashes))
    chunks = [tokens[i * BS : (i + 1) * BS] for i in range(len(hashes))]
    pool.cache_blocks(blocks, hashes, chunks, parent=None, session_id=session_id)
    return blocks


def test_stored_event_carries_chain_and_tokens() -> None:
    pool, events = _pool()
    tokens = list(range(8))
    _store(pool, tokens, session_id="conv-1")
    hashes = block_hashes(tokens, BS)
    assert events == [
        BlockStored(
            block_hashes=[external_block_hash(h) for h in hashes],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            session_id="conv-1",
        )
    ]


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    pool, events = _pool(4)
    a = _store(pool, [1] * 8)  # blocks 0, 1
    b = _store(pool, [2] * 8)  # blocks 2, 3
    pool.free(a)
    pool.free(b)
    events.clear()
    hashes_a = block_hashes([1] * 8, BS)
    assert pool.find_cached_prefix(hashes_a) == a  # still a hit after free
    pool.allocate(1)  # evicts the least recently freed: a's tail block first
    assert events == [BlockRemoved(block_hashes=[external_block_hash(hashes_a[1])], medium="GPU")]
    assert pool.find_cached_prefix(hashes_a) == a[:1]


def test_pinned_blocks_are_never_evicted() -> None:
    pool, _ = _pool(4)
    pinned = _store(pool, [1] * 8)
    other = _store(pool, [2] * 8)
    pool.free(other)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert pool.find_cached_prefix(block_hashes([1] * 8, BS)) == pinned
    assert all(block.ref_cnt == 1 for block in pinned)


def test_touch_takes_hits_out_of_the_free_queue() -> None:
    pool, _ = _pool(2)
    blocks = _store(pool, [3] * 8)
    pool.free(blocks)
    assert pool.num_free == 2
    pool.touch(blocks)
    assert pool.num_free == 0
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)


def test_reset_refused_while_in_use_then_clears() -> None:
    pool, events = _pool(2)
    blocks = _store(pool, [4] * 8)
    events.clear()
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert events == [AllBlocksCleared()]
    assert pool.num_cached == 0


def test_disabled_caching_never_hits_nor_emits() -> None:
    events: list[Event] = []
    pool = BlockPool(4, BS, enable_caching=False, emit=events.append)
    tokens = [5] * 8
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, block_hashes(tokens, BS), [tokens[:4], tokens[4:]], parent=None)
    pool.free(blocks)
    assert pool.find_cached_prefix(block_hashes(tokens, BS)) == []
    assert events == []


def test_block_0_is_the_null_block_and_never_handed_out() -> None:
    """As in vLLM: block 0 stands for freed positions (a sliding window's), so a request's
    block ids, and D's params, never name it."""
    pool, _ = _pool(4)
    assert sorted(b.block_id for b in pool.allocate(4)) == [1, 2, 3, 4]
    assert pool.num_free == 0 and pool.num_blocks == 4
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)

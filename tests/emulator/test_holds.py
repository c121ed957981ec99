"""Held blocks as the side channel serves them: reads in the order asked, notifies freeing
them once, and reads of blocks no longer (or never) held returning what memory holds now."""

from __future__ import annotations

import pytest

from emulator.blocks import Block
from emulator.holds import REGISTRATION_GENERATION, HeldBlockTable
from emulator.kvmodel import GENESIS_KV, chain_kv, token_kv
from emulator.sidechannel import Notify, ReadBlocks, SideChannelError
from tests.emulator.helpers import async_test


def _blocks(ids: list[int]) -> list[Block]:
    return [Block(block_id=i, kv=bytearray(bytes([i]) * 32)) for i in ids]


@async_test()
async def test_reads_concatenate_in_the_order_asked_and_notify_frees_once() -> None:
    freed: list[list[Block]] = []
    memory = _blocks(list(range(10)))
    table = HeldBlockTable("engine-a", freed.append, memory)
    blocks = [memory[7], memory[3], memory[9]]
    table.hold("req-1", blocks, ttl=60)
    read = ReadBlocks(engine_id="engine-a", request_id="req-1", block_ids=[9, 7])
    assert table.read_blocks(read) == bytes([9]) * 32 + bytes([7]) * 32
    assert table.read_blocks(read) == bytes([9]) * 32 + bytes([7]) * 32  # reads may repeat
    assert table.unheld_reads == 0

    with pytest.raises(SideChannelError, match="stale registration generation"):
        stale = REGISTRATION_GENERATION + 1
        table.read_blocks(ReadBlocks("engine-a", "req-1", [3], registration_generation=stale))
    with pytest.raises(SideChannelError, match="unknown engine"):
        table.read_blocks(ReadBlocks(engine_id="engine-b", request_id="req-1", block_ids=[3]))
    with pytest.raises(SideChannelError, match=r"blocks \[10\] are outside the registered KV memory"):
        table.read_blocks(ReadBlocks(engine_id="engine-a", request_id="req-1", block_ids=[3, 10]))

    table.release_blocks(Notify(engine_id="engine-a", request_id="req-1"))
    assert freed == [blocks] and len(table) == 0
    table.release_blocks(Notify(engine_id="engine-a", request_id="req-1"))  # unknown now: logged only
    assert freed == [blocks]


@async_test()
async def test_stale_and_wrong_reads_return_what_the_memory_holds_now() -> None:
    """As a NIXL read: no hold is checked. A read after the release, or of blocks never held
    for the request, returns the blocks' current KV, and is counted as unheld."""
    memory = _blocks(list(range(10)))
    table = HeldBlockTable("engine-a", lambda _: None, memory)
    table.hold("req-1", [memory[2], memory[3]], ttl=60)
    assert table.read_blocks(ReadBlocks("engine-a", "req-1", [4, 3])) == bytes([4]) * 32 + bytes([3]) * 32
    assert table.unheld_reads == 1
    table.release_blocks(Notify(engine_id="engine-a", request_id="req-1"))
    memory[2].kv[:] = bytes([99]) * 32  # the freed block went to another request
    assert table.read_blocks(ReadBlocks("engine-a", "req-1", [2])) == bytes([99]) * 32
    assert table.unheld_reads == 2


def test_chained_kv_equals_token_by_token_kv() -> None:
    tokens = [256, 72, 105, 257, 10, 0, 255]
    expected, previous = b"", GENESIS_KV
    for position, token in enumerate(tokens, start=5):
        previous = token_kv(previous, position, token)
        expected += previous
    assert chain_kv(GENESIS_KV, 5, tokens) == expected
    assert chain_kv(expected[-8:], 12, []) == b""

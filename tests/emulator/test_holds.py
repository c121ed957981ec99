"""Held blocks as the side channel serves them: reads in the order asked, single use."""

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
    table = HeldBlockTable("engine-a", freed.append)
    blocks = _blocks([7, 3, 9])
    table.hold("req-1", blocks, ttl=60)
    read = ReadBlocks(engine_id="engine-a", request_id="req-1", block_ids=[9, 7])
    assert table.read_blocks(read) == bytes([9]) * 32 + bytes([7]) * 32
    assert table.read_blocks(read) == bytes([9]) * 32 + bytes([7]) * 32  # reads may repeat

    with pytest.raises(SideChannelError, match=r"blocks \[4, 5\] are not held"):
        table.read_blocks(ReadBlocks(engine_id="engine-a", request_id="req-1", block_ids=[4, 3, 5]))
    with pytest.raises(SideChannelError, match="stale registration generation"):
        stale = REGISTRATION_GENERATION + 1
        table.read_blocks(ReadBlocks("engine-a", "req-1", [3], registration_generation=stale))
    with pytest.raises(SideChannelError, match="unknown engine"):
        table.read_blocks(ReadBlocks(engine_id="engine-b", request_id="req-1", block_ids=[3]))

    table.release_blocks(Notify(engine_id="engine-a", request_id="req-1"))
    assert freed == [blocks] and len(table) == 0
    with pytest.raises(SideChannelError, match="unknown request"):
        table.read_blocks(read)
    with pytest.raises(SideChannelError, match="unknown request"):
        table.release_blocks(Notify(engine_id="engine-a", request_id="req-1"))
    assert freed == [blocks]


def test_chained_kv_equals_token_by_token_kv() -> None:
    tokens = [256, 72, 105, 257, 10, 0, 255]
    expected, previous = b"", GENESIS_KV
    for position, token in enumerate(tokens, start=5):
        previous = token_kv(previous, position, token)
        expected += previous
    assert chain_kv(GENESIS_KV, 5, tokens) == expected
    assert chain_kv(expected[-8:], 12, []) == b""

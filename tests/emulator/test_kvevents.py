"""KV-event structs: vLLM 0.33.0's bytes decode and re-encode byte-identically."""

from __future__ import annotations

import json

import msgspec

from emulator.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from tests.factories import VECTORS


def _vector(name: str) -> bytes:
    return (VECTORS / name).read_bytes()


def test_int_hash_batch_round_trips_byte_identically() -> None:
    raw = _vector("kv_events_batch_vllm_0.33.0.msgpack")
    batch = decode_batch(raw)
    assert encode_batch(batch) == raw
    stored, stored2, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [11111111111111111, 22222222222222222]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(32))
    assert (stored.block_size, stored.medium, stored.lora_id) == (16, "GPU", None)
    assert isinstance(stored2, BlockStored)
    assert (stored2.group_idx, stored2.session_id) == (0, "conv-7")
    assert stored2.parent_block_hash == 22222222222222222
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [11111111111111111]
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.data_parallel_rank == 0


def test_decoded_batch_matches_the_readable_json() -> None:
    raw = _vector("kv_events_batch_vllm_0.33.0.msgpack")
    readable = json.loads(_vector("kv_events_batch_vllm_0.33.0.json"))
    assert msgspec.to_builtins(decode_batch(raw)) == readable


def test_bytes_hash_batch_round_trips_byte_identically() -> None:
    raw = _vector("kv_events_batch_bytes_hashes_vllm_0.33.0.msgpack")
    batch = decode_batch(raw)
    assert encode_batch(batch) == raw
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [bytes(range(32))]


def test_built_events_encode_like_vllm() -> None:
    raw = _vector("kv_events_batch_vllm_0.33.0.msgpack")
    built = KVEventBatch(
        ts=1764420000.5,
        events=[
            BlockStored(
                block_hashes=[11111111111111111, 22222222222222222],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockStored(
                block_hashes=[33333333333333333],
                parent_block_hash=22222222222222222,
                token_ids=list(range(32, 48)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                session_id="conv-7",
            ),
            BlockRemoved(block_hashes=[11111111111111111], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert encode_batch(built) == raw


def test_unknown_fields_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "future": [1, 2]}], 0]
    )
    (event,) = decode_batch(payload).events
    assert event == BlockRemoved(block_hashes=[1], medium="GPU")


def test_seq_frames() -> None:
    assert encode_seq(0) == bytes(8)
    assert decode_seq(encode_seq(12345)) == 12345
    assert encode_seq(-1) == b"\xff" * 8
    assert decode_seq(b"\xff" * 8) == -1

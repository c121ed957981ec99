"""KV-cache events in vLLM's wire format (``vllm/distributed/kv_events.py``).

A published ZMQ message is ``[topic, seq, payload]``: ``seq`` is an 8-byte
big-endian counter from 0 per engine start, ``payload`` a msgpack
``[ts, events, data_parallel_rank]`` in which every event is a map tagged by
``"type"``. Fields equal to their default are omitted; unknown fields are
ignored when decoding. These structs decode what a real engine sends and encode
byte-identically to vLLM 0.33 (see ``tests/vectors``).
"""

from __future__ import annotations

from typing import Any

import msgspec

#: A block hash as events carry it: 64-bit int (default) or raw digest bytes.
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"
#: seq frame that ends a replay answer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    array_like=False,
    tag_field="type",
    tag=True,
):
    """Base of every KV-cache event; encoded as a map with a ``"type"`` tag."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """One published payload: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack payload of a batch, as vLLM's publisher encodes it."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Batch of a msgpack payload; raises msgspec.DecodeError on garbage."""
    return _DECODER.decode(payload)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian seq frame."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """The seq of an 8-byte big-endian frame (-1 ends a replay)."""
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)

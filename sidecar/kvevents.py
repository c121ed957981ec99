"""Decoding of vLLM's KV-event payloads (the third frame of a ZMQ message).

A payload is msgpack ``[ts, events, data_parallel_rank]``. Two encodings of an
event exist and both are accepted:

- current (vLLM >= 0.11-ish, checked against 0.33 bytes): a map tagged by
  ``"type"`` — ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` — whose
  fields equal to their default may be absent and whose unknown fields are
  ignored;
- older (``array_like=True``): an array ``[tag, field1, field2, ...]`` with
  ``block_hashes`` as the first field.

Only the block hashes matter to the index. A hash is a 64-bit int (masked to
64 bits: old releases sent Python's signed ``hash()``) or raw digest bytes, of
which the low 64 bits are taken, big-endian (what vLLM puts in int events).
An event of an unknown type is skipped and counted; anything else that does
not decode makes the payload malformed (`MalformedPayload`).

The frames around a payload: `decode_seq` (the seq frame), and `replay_answer`
(a replay message, in the shape of current vLLM or of older releases). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvferry.decoding import UNDECODABLE

MASK64 = (1 << 64) - 1

_Hash = int | bytes


class MalformedPayload(ValueError):
    """A payload that is not a KV-event batch in either encoding."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks entered the prefix cache."""

    hashes: list[int]


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks left the prefix cache."""

    hashes: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The whole prefix cache was reset."""


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """The events of one payload, in order, and how many were of unknown types."""

    events: list[KvEvent]
    unknown: int = 0


# -- current encoding: maps tagged by "type" ---------------------------------------


class _MapStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[_Hash]
    medium: str | None = None


class _MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


_MapEvent = _MapStored | _MapRemoved | _MapCleared


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


# -- older encoding: arrays [tag, field, ...] ------------------------------------------


class _ArrStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[_Hash]
    # (skipped over, not built: a block's token ids are the bulk of a payload)
    parent_block_hash: msgspec.Raw = msgspec.Raw(b"")
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    block_size: msgspec.Raw = msgspec.Raw(b"")
    lora_id: msgspec.Raw = msgspec.Raw(b"")
    medium: str | None = None


class _ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


_ArrEvent = _ArrStored | _ArrRemoved | _ArrCleared


class _ArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def hash64(h: int | bytes) -> int:
    """A block hash in the index's 64-bit form."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & MASK64


def _hashes(raw: list[_Hash]) -> list[int]:
    # Fast path: vLLM's default int hashes, already non-negative.
    if all(type(h) is int for h in raw):
        ints: list[int] = raw  # type: ignore[assignment]
        return ints if not ints or min(ints) >= 0 else [h & MASK64 for h in ints]
    return [hash64(h) for h in raw]


#: Where the prefix cache a prefill reuses lives. vLLM's KV offloading connectors put their
#: own events ("CPU", and storage tiers) in the same batches: blocks a prompt would have
#: to load first are not a cache hit to steer it by.
_DEVICE_MEDIA = (None, "GPU")


def _convert(event: Any) -> KvEvent | None:
    """The event for the index (None: one of another medium than the device's)."""
    if isinstance(event, _MapStored | _ArrStored):
        return Stored(_hashes(event.block_hashes)) if event.medium in _DEVICE_MEDIA else None
    if isinstance(event, _MapRemoved | _ArrRemoved):
        return Removed(_hashes(event.block_hashes)) if event.medium in _DEVICE_MEDIA else None
    return Cleared()


class Decoder:
    """Decodes payloads; remembers which encoding the engine uses and tries it first."""

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(_MapBatch)
        self._arr = msgspec.msgpack.Decoder(_ArrBatch)
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._map_event = msgspec.msgpack.Decoder(_MapEvent)
        self._arr_event = msgspec.msgpack.Decoder(_ArrEvent)
        self._any = msgspec.msgpack.Decoder()
        self._prefer_arrays = False

    def decode(self, payload: bytes) -> DecodedBatch:
        """The events of a payload; raises MalformedPayload."""
        first, second = (self._arr, self._map) if self._prefer_arrays else (self._map, self._arr)
        for decoder in (first, second):
            try:
                batch = decoder.decode(payload)
            except UNDECODABLE:
                continue
            self._prefer_arrays = decoder is self._arr
            return DecodedBatch([c for e in batch.events if (c := _convert(e)) is not None])
        return self._decode_leniently(payload)

    def _decode_leniently(self, payload: bytes) -> DecodedBatch:
        """Event by event: mixed encodings, unknown event types skipped."""
        try:
            batch = self._raw.decode(payload)
        except UNDECODABLE as e:
            raise MalformedPayload(f"not a KV-event batch: {e}") from e
        events: list[KvEvent] = []
        unknown = 0
        for raw in batch.events:
            known, event = self._decode_event(raw)
            unknown += not known
            if event is not None:
                events.append(event)
        return DecodedBatch(events, unknown)

    def _decode_event(self, raw: msgspec.Raw) -> tuple[bool, KvEvent | None]:
        """(whether its type is known, the event for the index or None)."""
        for decoder in (self._map_event, self._arr_event):
            try:
                decoded = decoder.decode(raw)
            except UNDECODABLE:
                continue
            return True, _convert(decoded)
        try:
            value = self._any.decode(raw)
        except UNDECODABLE as e:
            raise MalformedPayload(f"undecodable event: {e}") from e
        if isinstance(value, dict):
            tag = value.get("type")
        elif isinstance(value, list) and value:
            tag = value[0]
        else:
            tag = None
        if isinstance(tag, str) and tag not in _KNOWN_TAGS:
            return False, None  # a newer event type: not ours to understand
        raise MalformedPayload(f"malformed {tag!r} event")


@dataclass(frozen=True, slots=True)
class ReplayAnswer:
    """One message of a replay, as a DEALER receives it."""

    seq: int
    """The batch's seq; -1 ends the replay."""
    payload: bytes

    @property
    def end(self) -> bool:
        return self.seq == -1


def replay_answer(frames: list[bytes]) -> ReplayAnswer:
    """One replay message in either shape; ValueError when it is neither.

    After the DEALER's empty delimiter frame, vLLM >= 0.32 (and current
    ``vllm/distributed/kv_events.py``) sends ``[topic, seq, payload]`` per batch, the
    topic frame there even when the topic is empty, and ends with ``[b"", seq -1,
    b""]``; older releases (and SGLang) send ``[seq, payload]`` and end with ``[seq -1,
    b""]``. The two are told apart by their frame count (4 and 3 with the delimiter), and
    each frame is checked (an empty delimiter, an 8-byte seq, no seq below -1): a
    message of one shape never reads as the other."""
    if not frames or frames[0] != b"":
        raise ValueError("replay answer without the empty delimiter frame")
    if len(frames) == 4:  # [b"", topic, seq, payload]
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3:  # [b"", seq, payload]
        seq_frame, payload = frames[1], frames[2]
    else:
        raise ValueError(
            f"replay answer of {len(frames)} frames: expected [b'', topic, seq, payload] "
            "or [b'', seq, payload]"
        )
    seq = decode_seq(seq_frame)
    if seq < -1:
        raise ValueError(f"replay answer with seq {seq}")
    return ReplayAnswer(seq, payload)


def decode_seq(frame: bytes) -> int:
    """The seq of an 8-byte big-endian frame (-1 ends a replay); ValueError otherwise."""
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian seq frame."""
    return seq.to_bytes(8, "big", signed=True)

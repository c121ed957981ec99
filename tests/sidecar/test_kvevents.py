"""Decoding vLLM's KV-event payloads: the current map encoding (real vLLM 0.33 bytes) and the older arrays."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.kvevents import (
    MASK64,
    Cleared,
    Decoder,
    MalformedPayload,
    Removed,
    ReplayAnswer,
    Stored,
    decode_seq,
    encode_seq,
    hash64,
    replay_answer,
)
from tests.factories import VECTORS

_pack = msgspec.msgpack.encode


def test_vllm_033_batch_with_int_hashes() -> None:
    batch = Decoder().decode((VECTORS / "kv_events_batch_vllm_0.33.0.msgpack").read_bytes())
    assert batch.events == [
        Stored([11111111111111111, 22222222222222222]),
        Stored([33333333333333333]),  # carries group_idx and session_id: ignored
        Removed([11111111111111111]),
        Cleared(),
    ]
    assert batch.unknown == 0


def test_vllm_033_batch_with_byte_hashes_takes_the_low_64_bits() -> None:
    batch = Decoder().decode((VECTORS / "kv_events_batch_bytes_hashes_vllm_0.33.0.msgpack").read_bytes())
    digest = bytes(range(32))
    assert batch.events == [Stored([int.from_bytes(digest[-8:], "big")])]


def test_older_array_encoding() -> None:
    payload = _pack(
        [
            1700000000.0,
            [
                ["BlockStored", [1, 2], None, list(range(32)), 16, None],  # before `medium`
                ["BlockStored", [3], 2, list(range(16)), 16, None, "GPU", None, "future-field"],
                ["BlockRemoved", [1], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]  # no data_parallel_rank: older still
    )
    batch = Decoder().decode(payload)
    assert batch.events == [Stored([1, 2]), Stored([3]), Removed([1]), Cleared()]


def test_events_of_offloaded_blocks_are_not_the_device_cache() -> None:
    """vLLM's KV offloading connectors put their events ("CPU", storage tiers) in the same
    batches: a block a prompt would first have to load is no prefix-cache hit."""
    maps = _pack(
        [
            0.0,
            [
                {"type": "BlockStored", "block_hashes": [1], "medium": "GPU"},
                {"type": "BlockStored", "block_hashes": [2], "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [3]},  # (no medium: the device's)
            ],
            0,
        ]
    )
    arrays = _pack(
        [
            0.0,
            [
                ["BlockStored", [1], None, list(range(16)), 16, None, "GPU"],
                ["BlockStored", [2], None, list(range(16)), 16, None, "CPU"],
                ["BlockRemoved", [1], "CPU"],
                ["BlockRemoved", [3]],
            ],
        ]
    )
    for payload in (maps, arrays):
        batch = Decoder().decode(payload)
        assert batch.events == [Stored([1]), Removed([3])] and batch.unknown == 0
    mixed = _pack([0.0, [{"type": "BlockStored", "block_hashes": [2], "medium": "CPU"}, ["Future"]], 0])
    batch = Decoder().decode(mixed)  # (decoded event by event)
    assert batch.events == [] and batch.unknown == 1


def test_python_hash_values_are_masked_to_64_bits() -> None:
    payload = _pack([0.0, [["BlockStored", [-1, -(2**63)], None, [], 16, None]], 0])
    assert Decoder().decode(payload).events == [Stored([MASK64, 2**63])]
    assert hash64(-1) == MASK64 and hash64(b"\x01" * 40) == int.from_bytes(b"\x01" * 8, "big")


def test_absent_defaults_and_unknown_fields_in_maps() -> None:
    payload = _pack(
        [
            0.0,
            [
                {"type": "BlockStored", "block_hashes": [7], "brand_new": {"x": 1}},
                {"type": "BlockRemoved", "block_hashes": [7]},
            ],
        ]
    )
    assert Decoder().decode(payload).events == [Stored([7]), Removed([7])]


def test_unknown_event_types_are_skipped_and_counted() -> None:
    payload = _pack(
        [
            0.0,
            [
                {"type": "BlockStored", "block_hashes": [7]},
                {"type": "BlockPromoted", "block_hashes": [7], "tier": "CPU"},
                ["SomethingElse", 1, 2],
                {"type": "BlockRemoved", "block_hashes": [7]},
            ],
            0,
        ]
    )
    batch = Decoder().decode(payload)
    assert batch.events == [Stored([7]), Removed([7])] and batch.unknown == 2


def test_the_decoder_follows_an_engine_that_switches_encodings() -> None:
    decoder = Decoder()
    arrays = _pack([0.0, [["BlockStored", [1], None, [], 16, None]]])
    maps = _pack([0.0, [{"type": "BlockStored", "block_hashes": [2]}]])
    assert decoder.decode(arrays).events == [Stored([1])]
    assert decoder.decode(maps).events == [Stored([2])]
    assert decoder.decode(arrays).events == [Stored([1])]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        _pack({"ts": 0.0}),
        _pack([0.0, "not-a-list"]),
        _pack([0.0, [{"type": "BlockStored", "block_hashes": "nope"}]]),
        _pack([0.0, [{"type": "BlockStored"}]]),
        _pack([0.0, [["BlockRemoved", [1.5]]]]),
        _pack([0.0, [42]]),
        # nested deeper than msgspec recurses (RecursionError): 3 KB an engine bug could send
        b"\x93" + _pack(1.0) + b"\x91" + b"\x91" * 3000 + b"\x90" + _pack(0),
        _pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "extra": 0}]])[:-1]
        + b"\x91" * 3000
        + b"\x90",
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(MalformedPayload):
        Decoder().decode(payload)


def test_seq_frames() -> None:
    assert decode_seq(encode_seq(5)) == 5 and decode_seq(b"\xff" * 8) == -1
    assert encode_seq(1) == b"\x00" * 7 + b"\x01"
    with pytest.raises(ValueError):
        decode_seq(b"\x00" * 4)


_SEQ7 = (7).to_bytes(8, "big", signed=True)
_END = (-1).to_bytes(8, "big", signed=True)


def test_replay_answers_of_current_vllm() -> None:
    """vLLM 0.32 (kv_events.py `_service_replay`): [topic, seq, payload] after the DEALER's
    delimiter, the topic frame there even when empty; the end is [b"", seq -1, b""]."""
    assert replay_answer([b"", b"kv", _SEQ7, b"batch"]) == ReplayAnswer(7, b"batch")
    assert replay_answer([b"", b"", _SEQ7, b"batch"]) == ReplayAnswer(7, b"batch")
    # a topic that happens to be 8 bytes long is still a topic: the count decides
    assert replay_answer([b"", b"8-bytes!", _SEQ7, b"batch"]) == ReplayAnswer(7, b"batch")
    end = replay_answer([b"", b"", _END, b""])
    assert end.end and end.payload == b""


def test_replay_answers_of_older_releases() -> None:
    """Older vLLM releases and SGLang: [seq, payload]; the end is [seq -1, b""]."""
    assert replay_answer([b"", _SEQ7, b"batch"]) == ReplayAnswer(7, b"batch")
    assert replay_answer([b"", _SEQ7, b""]) == ReplayAnswer(
        7, b""
    )  # (an empty payload: the decoder's to judge)
    end = replay_answer([b"", _END, b""])
    assert end.end and end.payload == b""


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"", _SEQ7],  # too few
        [b"", b"kv", _SEQ7, b"batch", b"more"],  # too many
        [b"x", b"kv", _SEQ7, b"batch"],  # no empty delimiter
        [b"x", _SEQ7, b"batch"],
        [b"", b"kv", b"\x07", b"batch"],  # seq frame not 8 bytes
        [b"", b"kv", _SEQ7],  # current shape's frames, older one's count: the seq is "kv"
        [b"", (-2).to_bytes(8, "big", signed=True), b""],
    ],
)
def test_a_replay_answer_of_neither_shape_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(ValueError):
        replay_answer(frames)

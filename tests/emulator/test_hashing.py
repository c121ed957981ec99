"""Block hashes: vLLM's chained sha256_cbor, checked against a hand-rolled CBOR encoder."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.blockhash import (
    DEFAULT_NONE_HASH_SEED,
    block_hashes,
    external_block_hash,
    hash_block_tokens,
    none_hash,
)


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | code]) + value.to_bytes(size, "big")
    raise ValueError(value)


def _reference_block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """sha256 over CBOR [bytes parent, [uint tokens], null], written out by hand."""
    encoded = bytes([0x83]) + _cbor_head(2, len(parent)) + parent + _cbor_head(4, len(tokens))
    encoded += b"".join(_cbor_head(0, t) for t in tokens) + b"\xf6"
    return hashlib.sha256(encoded).digest()


def _reference_none_hash(seed: str) -> bytes:
    raw = seed.encode()
    return hashlib.sha256(_cbor_head(3, len(raw)) + raw).digest()


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_none_hash_defaults_to_the_fixed_seed() -> None:
    assert DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert none_hash() == _reference_none_hash("vllm-none-hash")
    assert len(none_hash()) == 32


def test_pythonhashseed_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash() == _reference_none_hash("0")
    assert none_hash() != _reference_none_hash("vllm-none-hash")


def test_chain_matches_reference_encoding() -> None:
    tokens = list(range(250, 250 + 40))  # crosses the 1-byte/2-byte CBOR boundary
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # the partial third block has no hash
    first = _reference_block_hash(none_hash(), tokens[:16])
    assert hashes == [first, _reference_block_hash(first, tokens[16:32])]
    assert hash_block_tokens(None, tokens[:16]) == first


def test_chaining_makes_position_matter() -> None:
    block = list(range(16))
    hashes = block_hashes(block + block, 16)
    assert hashes[0] != hashes[1]  # same tokens, different parent
    assert block_hashes([1, *block[1:], *block], 16)[1] != hashes[1]  # history changes later hashes


def test_extending_from_a_parent_equals_hashing_the_whole() -> None:
    tokens = list(range(64))
    whole = block_hashes(tokens, 16)
    assert block_hashes(tokens[32:], 16, parent=whole[1]) == whole[2:]


@given(st.lists(st.integers(min_value=0, max_value=257), max_size=80), st.sampled_from([1, 4, 16]))
def test_hashes_are_deterministic_and_prefix_stable(tokens: list[int], block_size: int) -> None:
    hashes = block_hashes(tokens, block_size)
    assert hashes == block_hashes(list(tokens), block_size)
    assert len(hashes) == len(tokens) // block_size
    longer = block_hashes([*tokens, 7] * 2, block_size)
    assert longer[: len(hashes)] == hashes


def test_external_hash_is_low_64_bits_big_endian() -> None:
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert external_block_hash(b"\xff" * 32) == 2**64 - 1

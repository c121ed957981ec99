"""Block hashes: vLLM's chained sha256_cbor, checked against a hand-rolled CBOR encoder, and
the emulator's own hasher (no CBOR library, a memo) checked against both."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator import hashing
from emulator.hashing import BlockHasher
from emulator.tokenizer import IM_END
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


# --- the emulator's own hasher: same digests, no CBOR library call per block, memoized ---

_token = st.one_of(
    st.integers(min_value=0, max_value=257),
    st.integers(min_value=0, max_value=23),
    st.integers(min_value=0, max_value=2**40),
    st.integers(min_value=-(2**20), max_value=-1),
)


@given(
    st.lists(_token, max_size=120),
    st.sampled_from([1, 4, 16, 24, 30]),
    st.sampled_from([None, bytes(range(32)), b"short parent"]),
)
def test_emulator_hasher_matches_kvferry(tokens: list[int], block_size: int, parent: bytes | None) -> None:
    root = none_hash()
    hasher = BlockHasher(block_size, root)
    expected = block_hashes(tokens, block_size, parent=parent, root=root)
    assert hasher.hash_blocks(tokens, parent) == expected
    assert hasher.hash_blocks(tokens, parent) == expected  # answered from the memo


@given(
    st.lists(st.integers(min_value=0, max_value=257), min_size=16, max_size=200),
    st.lists(st.integers(min_value=0, max_value=257), max_size=60),
    st.integers(min_value=1, max_value=4),
)
def test_memo_is_exact_for_extended_and_diverged_sequences(
    prefix: list[int], tail: list[int], memo_blocks: int
) -> None:
    root = none_hash()
    hasher = BlockHasher(4, root, memo_blocks=memo_blocks)  # tiny memo: generations rotate
    hasher.hash_blocks(prefix)
    for tokens in (prefix + tail, [prefix[0] ^ 1, *prefix[1:]], prefix[:-5] + tail, prefix):
        assert hasher.hash_blocks(tokens) == block_hashes(tokens, 4, root=root)
    extended = block_hashes(prefix[:16] + tail, 4, root=root)
    assert hasher.hash_blocks(tail, parent=extended[3]) == extended[4:]


def test_memo_answers_the_next_turn_without_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    hasher = BlockHasher(16, none_hash())
    turn1 = [ord(c) for c in "the previous turn of a conversation " * 20]
    first = hasher.hash_blocks(turn1)
    turn2 = turn1 + [IM_END, 10] + [ord(c) for c in "and the next one " * 4]
    expected = block_hashes(turn2, 16, root=none_hash())
    calls = 0
    real_sha256 = hashlib.sha256

    def counting_sha256(data: bytes) -> Any:
        nonlocal calls
        calls += 1
        return real_sha256(data)

    monkeypatch.setattr(hashing.hashlib, "sha256", counting_sha256)
    second = hasher.hash_blocks(turn2)
    assert second == expected and second[: len(first)] == first
    assert calls == len(second) - len(first)  # only the new blocks were hashed


@given(
    st.lists(st.integers(0, 300), min_size=0, max_size=200),
    st.lists(
        st.tuples(
            st.sampled_from(["extend", "edit", "cut", "other"]), st.integers(0, 199), st.integers(0, 300)
        ),
        max_size=8,
    ),
)
def test_hash_prompt_equals_hashing_every_block(
    first: list[int], changes: list[tuple[str, int, int]]
) -> None:
    """However prompts relate to the remembered ones, the digests are vLLM's."""
    hasher = BlockHasher(4, none_hash(), memo_prompts=2)
    prompt = first
    for kind, at, token in [("extend", 0, 0), *changes]:
        if kind == "extend":
            prompt = prompt + [token] * 9
        elif kind == "edit" and prompt:
            i = at % len(prompt)
            prompt = [*prompt[:i], token, *prompt[i + 1 :]]
        elif kind == "cut":
            prompt = prompt[: at % (len(prompt) + 1)]
        else:
            prompt = [token, *prompt]
        assert hasher.hash_prompt(list(prompt)) == block_hashes(prompt, 4)


def test_a_salted_prompt_chains_from_its_salted_first_block() -> None:
    """vLLM's generate_block_hash_extra_keys: the cache salt goes with the first block only."""
    hasher = BlockHasher(4, b"root")
    tokens = list(range(10))
    salted = hasher.hash_prompt(tokens, "s")
    first = hash_block_tokens(None, tokens[:4], ("s",), root=b"root")
    assert salted == [first, hash_block_tokens(first, tokens[4:8], root=b"root")]
    assert salted[0] != hasher.hash_prompt(tokens)[0] and hasher.hash_prompt(tokens[:3], "s") == []

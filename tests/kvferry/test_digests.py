"""The block digest format is shared by every sidecar and router of a deployment (and
kept in etcd with each retention): a change to it must be deliberate."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.digests import DIGEST_SIZE, DigestCache, block_digests, seed


def test_digests_of_full_blocks_keep_their_format() -> None:
    tokens = [*range(40), *[2**32 - 1] * 8]  # 3 full blocks of 16
    got = block_digests(tokens, 16, seed("m"))
    assert len(got) == 3 * DIGEST_SIZE
    assert got.hex() == (
        "cb3e7abb15380c6016a8f37f3060717306b9ef7b12cd5668338bda63332527da4b36cefdd3196a1acc61bfa467dafec5"
    )
    assert block_digests(tokens[:47], 16, seed("m")) == got[: 2 * DIGEST_SIZE]  # partial block: none


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
def test_token_ids_outside_uint32_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="token ids must be integers"):
        block_digests([1] * 15 + [bad], 16, seed("m"))  # type: ignore[list-item]


# -- the cache of a conversation's last digests ---------------------------------------------------

_turns = st.lists(
    st.tuples(
        st.integers(0, 3),  # the conversation
        st.integers(0, 300),  # tokens kept from that conversation's last sequence
        st.lists(st.integers(0, 50), max_size=60),  # then these
        st.sampled_from([(4, "m"), (4, "m"), (4, "m"), (8, "m"), (4, "other")]),  # block size, model
    ),
    max_size=25,
)


@given(_turns, st.integers(0, 4000))
@settings(max_examples=300, deadline=None)
def test_cached_digests_are_block_digests(turns: list[Any], max_bytes: int) -> None:
    """Whatever each conversation's sequence becomes (grown, cut, edited, another block
    size or model), the cache answers exactly `block_digests`, within its byte bound."""
    cache = DigestCache(max_bytes)
    last: dict[int, list[int]] = {}
    for conversation, keep, more, (block_size, model) in turns:
        tokens = last.get(conversation, [])[:keep] + more
        last[conversation] = tokens
        got, reused = cache.digests(conversation, tokens, block_size, seed(model))
        assert got == block_digests(tokens, block_size, seed(model))
        assert 0 <= reused <= len(got) // DIGEST_SIZE
        assert cache.size_bytes <= max_bytes


def test_a_grown_sequence_hashes_only_its_new_blocks() -> None:
    cache = DigestCache(1 << 20)
    first = list(range(1000))
    assert cache.digests("c", first, 16, seed("m"))[1] == 0
    edited = first[:500] + [7] * 532  # blocks 0..30 as before (496 tokens), then new
    assert cache.digests("c", edited, 16, seed("m")) == (block_digests(edited, 16, seed("m")), 31)
    assert cache.digests("c", edited, 16, seed("other")) == (block_digests(edited, 16, seed("other")), 0)
    assert cache.digests("d", first, 16, seed("m")) == (block_digests(first, 16, seed("m")), 0)


def test_the_least_recently_used_conversation_leaves_first() -> None:
    tokens = list(range(160))  # 10 blocks
    one = DigestCache(1 << 20)
    one.digests("a", tokens, 16, seed("m"))
    cache = DigestCache(3 * one.size_bytes)  # room for three such
    for key in "abc":
        cache.digests(key, tokens, 16, seed("m"))
    cache.digests("a", tokens, 16, seed("m"))  # a is the most recent now
    cache.digests("d", tokens, 16, seed("m"))  # b leaves
    assert len(cache) == 3
    assert cache.digests("b", tokens, 16, seed("m"))[1] == 0  # b was gone (c leaves now)
    assert cache.digests("a", tokens, 16, seed("m"))[1] == 10  # a was kept

"""The block digest format is shared by every sidecar and router of a deployment (and
kept in etcd with each retention): a change to it must be deliberate."""

from __future__ import annotations

import pytest

from kvferry.digests import DIGEST_SIZE, block_digests, seed


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

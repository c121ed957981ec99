"""Pull decisions over plain data: counts, threshold, expiry, which remote blocks."""

from __future__ import annotations

from typing import Any

import pytest

from emulator.transfer import (
    HeldBlocks,
    PullAction,
    PullDirection,
    RemoteBlocks,
    describe_held_blocks,
    parse_remote,
    plan_pull,
    too_close_to_expiry,
)

BS = 16


def _decoder_params(**changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(100, 110))],
        "remote_engine_id": "d-engine",
        "remote_request_id": "req-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 150,
        "remote_blocks_expiry_time": 1000.0,
        "remote_registration_generation": 0,
        "future_key": "kept opaque",
    }
    params.update(changes)
    return params


def _source(**changes: Any) -> RemoteBlocks:
    source = parse_remote(_decoder_params(**changes), PullDirection.FROM_DECODER)
    assert source is not None
    return source


def _plan(source: RemoteBlocks | None, prompt_len: int = 200, cached: int = 0) -> Any:
    return plan_pull(source, prompt_len=prompt_len, cached_tokens=cached, block_size=BS, threshold=64)


def test_parse_needs_flag_ids_and_address() -> None:
    assert _source().block_ids == (tuple(range(100, 110)),)
    assert parse_remote(_decoder_params(), PullDirection.FROM_PREFILLER) is None
    assert parse_remote(_decoder_params(remote_block_ids=[]), PullDirection.FROM_DECODER) is None
    # ``[[]]`` is blocks given, as vLLM reads it (a truthy list): a pull then has too few.
    empty = parse_remote(_decoder_params(remote_block_ids=[[]]), PullDirection.FROM_DECODER)
    assert empty is not None and empty.block_ids == ((),)
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
        assert parse_remote(_decoder_params(**{key: None}), PullDirection.FROM_DECODER) is None
    with pytest.raises(ValueError):
        parse_remote(_decoder_params(remote_block_ids=[1, 2]), PullDirection.FROM_DECODER)
    # From a decoder, no remote_num_tokens means nothing to pull (vLLM: `... or 0`): a notify only.
    no_count = {k: v for k, v in _decoder_params().items() if k != "remote_num_tokens"}
    source = parse_remote(no_count, PullDirection.FROM_DECODER)
    assert source is not None and source.num_tokens == 0
    # Values no transfer could use: refused as bad params (a 400), not a crash in the pull.
    for bad in (
        {"remote_port": 70000},
        {"remote_port": 0},
        {"remote_block_ids": [[2**64]]},
        {"remote_block_ids": [[-1]]},
    ):
        with pytest.raises(ValueError):
            parse_remote(_decoder_params(**bad), PullDirection.FROM_DECODER)


def test_pull_takes_the_tail_of_a_list_that_covers_the_range() -> None:
    # 150 remote tokens = 10 blocks; 2 cached locally -> pull 118 tokens = 8 blocks,
    # the tail of the list, i.e. the list minus its first 2 entries.
    plan = _plan(_source(), cached=32)
    assert plan.action is PullAction.PULL
    assert plan.num_tokens == 150 - 32
    assert plan.first_local_block == 2
    assert plan.remote_block_ids == tuple(range(102, 110))


def test_prompt_shorter_than_remote_tokens_caps_the_count() -> None:
    plan = _plan(_source(), prompt_len=100)
    assert plan.num_tokens == 100
    assert plan.remote_block_ids == tuple(range(103, 110))  # tail: wrong unless the caller trims


def test_trimmed_params_pull_the_leading_blocks() -> None:
    plan = _plan(_source(remote_num_tokens=80, remote_block_ids=[list(range(100, 105))]))
    assert plan.remote_block_ids == tuple(range(100, 105))
    assert plan.num_tokens == 80


@pytest.mark.parametrize(
    ("changes", "cached", "reason"),
    [
        ({"remote_num_tokens": 0}, 0, "no_remote_tokens"),
        ({}, 160, "full_local_hit"),
        ({"remote_num_tokens": 63}, 0, "below_threshold"),
        ({}, 96, "below_threshold"),
    ],
)
def test_skips_still_notify(changes: dict[str, Any], cached: int, reason: str) -> None:
    plan = _plan(_source(**changes), cached=cached)
    assert (plan.action, plan.reason) == (PullAction.SKIP, reason)
    assert plan.notify


def test_no_source_means_nothing_to_notify() -> None:
    plan = _plan(None)
    assert plan.action is PullAction.SKIP
    assert not plan.notify


def test_refuses_within_five_seconds_of_expiry() -> None:
    """At the read (vLLM's worker checks there, after admission and allocation), not when
    the pull is planned."""
    source = _source()
    assert _plan(source).action is PullAction.PULL  # (planned whatever the time)
    assert not too_close_to_expiry(source, now=994.9)
    assert too_close_to_expiry(source, now=995.0)


def test_too_short_a_list_fails() -> None:
    """vLLM's worker asserts on it and its engine dies: the emulator fails the request and
    counts a connector fault, which the end-to-end tests require to stay at zero."""
    for ids in ([[1, 2, 3]], [[]]):
        plan = _plan(_source(remote_block_ids=ids))
        assert (plan.action, plan.reason) == (PullAction.FAIL, "too_few_remote_blocks")


def test_described_params_round_trip_through_parse() -> None:
    held = HeldBlocks("e", "r", "localhost", 5600, [4, 5], 20, 12.5, 0, 1)
    for_prefiller = describe_held_blocks(held, for_decoder=False)
    assert for_prefiller["do_remote_decode"] is True
    assert for_prefiller["do_remote_prefill"] is False
    assert for_prefiller["transfer_mode"] == "pull"
    source = parse_remote(for_prefiller, PullDirection.FROM_DECODER)
    assert source == RemoteBlocks("e", "r", "localhost", 5600, ((4, 5),), 20, 12.5, 0)
    for_decoder = describe_held_blocks(held, for_decoder=True)
    assert parse_remote(for_decoder, PullDirection.FROM_PREFILLER) == source

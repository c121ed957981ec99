"""Lookups whose caller verifies the prompt itself (caller_verifies): the daemon claims and
answers at once, handing back D's sequence to verify against, by the rule it would have
applied (kvferry.verification)."""

from __future__ import annotations

import grpc
import pytest

from kvferry.digests import block_digests
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2
from kvferry.verification import Held, pull_params, verdict
from tests.conftest import Client
from tests.factories import BLOCK, SEED, lease_request, lookup_request, node_request, tokens


def claim(conversation_id: str) -> leases_pb2.LookupRequest:
    return leases_pb2.LookupRequest(conversation_id=conversation_id, caller_verifies=True)


async def test_the_answer_hands_back_d_sequence_whole_and_claims_it_once(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c", num_tokens=1000, seq=tokens(1000)))
    answer = await client.leases.Lookup(claim("c"))
    assert (answer.decision, answer.reason, answer.claimed) == (leases_pb2.PULL, "pull", True)
    params = struct_to_dict(answer.kv_transfer_params)
    assert params["remote_num_tokens"] == 1000 and params["do_remote_decode"] is True
    check = answer.check
    assert (check.num_tokens, check.block_size, check.whole_only) == (1000, BLOCK, False)
    assert check.block_digests == block_digests(tokens(1000), BLOCK, SEED)
    assert check.recompute_threshold == 64
    again = await client.leases.Lookup(claim("c"))
    assert (again.decision, again.reason) == (leases_pb2.RECOMPUTE, "already_claimed")
    assert not again.HasField("check")


async def test_the_callers_verdict_is_the_one_the_daemon_gives(client: Client) -> None:
    """The same prompt, verified by the daemon (a prompt given) and by the caller (with
    what a caller_verifies answer handed back): the same tokens, the same params."""
    await client.nodes.Register(node_request("d-1"))
    edited = tokens(500) + [7] * 700  # the client edited the history after 500 tokens
    for conversation in ("daemon", "caller"):
        await client.leases.Register(lease_request(conversation, num_tokens=1000, seq=tokens(1000)))
    by_daemon = await client.leases.Lookup(lookup_request("daemon", 1200, seq=edited))
    answer = await client.leases.Lookup(claim("caller"))
    c = answer.check
    found = verdict(
        Held(c.num_tokens, c.block_size, c.block_digests, c.whole_only),
        1200,
        block_digests(edited, BLOCK, SEED),
        c.recompute_threshold,
    )
    assert (
        (found.reason, found.tokens) == (by_daemon.reason, by_daemon.reusable_tokens) == ("partial_pull", 496)
    )
    ours = pull_params(struct_to_dict(answer.kv_transfer_params), found.tokens, found.keep_blocks(BLOCK))
    assert ours == struct_to_dict(by_daemon.kv_transfer_params)


async def test_a_retention_without_digests_is_released_not_handed_out(client: Client) -> None:
    """Nothing to verify against: the caller could only pull unverified."""
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c", num_tokens=1000))
    answer = await client.leases.Lookup(claim("c"))
    assert (answer.decision, answer.reason, answer.claimed) == (leases_pb2.RECOMPUTE, "unverifiable", True)
    assert struct_to_dict(answer.release_params)["remote_num_tokens"] == 0
    assert not answer.HasField("check") and not answer.kv_transfer_params.fields


async def test_below_the_threshold_whatever_the_prompt_is_released(client: Client) -> None:
    await client.nodes.Register(node_request("d-1"))
    await client.leases.Register(lease_request("c", num_tokens=40, seq=tokens(40)))
    answer = await client.leases.Lookup(claim("c"))
    assert (answer.decision, answer.reason) == (leases_pb2.RECOMPUTE, "below_threshold")


@pytest.mark.parametrize(
    "extra",
    [{"prompt_tokens": 100}, {"peek": True}, {"prompt_digests": b""}],
    ids=["prompt_tokens", "peek", "prompt_digests"],
)
async def test_a_prompt_with_caller_verifies_is_refused(client: Client, extra: dict[str, object]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.leases.Lookup(
            leases_pb2.LookupRequest(conversation_id="c", caller_verifies=True, **extra)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "caller_verifies" in str(e.value.details())

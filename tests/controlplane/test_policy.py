"""The lookup decision, as a pure function: no I/O, no server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

import controlplane
from controlplane import convert
from controlplane.policy import (
    RELEASE,
    Decision,
    Handout,
    Policy,
    Prompt,
    Reason,
    decide,
    decide_claimed,
    holds_null_blocks,
    param_problems,
)
from controlplane.records import Claim, NodeRecord, NodeState, Retention, Role
from kvferry.digests import DIGEST_SIZE, block_digests, common_prefix_blocks, seed
from kvferry.structs import struct_to_dict
from tests.factories import d_params

NOW = 1_000_000.0
POLICY = Policy()
SEED = seed("m")


def node(generation: int = 1, alive: bool = True) -> NodeState:
    rec = NodeRecord("d-1", Role.DECODE, "m", 16, "http://d", "10.0.0.7", 5600, generation, NOW - 100, 10)
    return NodeState(rec, alive)


def retention(
    num_tokens: int = 1000,
    expires_in: float = 400,
    generation: int = 1,
    seq: list[int] | None = None,
    block_size: int = 16,
    whole_only: bool = False,
) -> Retention:
    return Retention(
        engine_id="d-1",
        generation=generation,
        params=b"(opaque: the serialized Struct)",
        num_tokens=num_tokens,
        block_size=block_size,
        created_at=NOW - 80,
        expires_at=NOW + expires_in,
        digests=block_digests(seq, block_size, SEED) if seq is not None else b"",
        whole_only=whole_only,
    )


def handout_of(params: dict[str, Any], h: Handout) -> dict[str, Any]:
    """D's `params` as P gets them for `h` (convert.apply_handout on the stored bytes)."""
    stored = struct_pb2.Struct()
    stored.update(params)
    out = struct_pb2.Struct()
    convert.apply_handout(stored.SerializeToString(), h, out)
    return struct_to_dict(out)


def handed(d: Decision, num_tokens: int = 1000) -> dict[str, Any]:
    """The params P would get for decision `d` on a retention of `num_tokens`."""
    assert d.params is not None
    return handout_of(d_params("d-1", num_tokens), d.params)


def test_pull_hands_over_all_of_ds_tokens_when_the_prompt_is_longer() -> None:
    d = decide(retention(), node(), Prompt(1500), POLICY, NOW)
    assert d.pull and d.reason == Reason.PULL and d.reusable_tokens == 1000
    assert handed(d)["remote_block_ids"] == [list(range(100, 163))]
    assert handed(d)["do_remote_decode"] is True and d.release is None


def test_prompt_shorter_than_d_trims_to_leading_blocks() -> None:
    d = decide(retention(), node(), Prompt(500), POLICY, NOW)
    assert d.pull and d.reason == Reason.PARTIAL_PULL and d.reusable_tokens == 500
    assert handed(d)["remote_num_tokens"] == 500
    assert handed(d)["remote_block_ids"] == [list(range(100, 132))]  # ceil(500/16) = 32 leading blocks


def test_reasons() -> None:
    assert decide(None, None, Prompt(10), POLICY, NOW).reason == Reason.NO_RETENTION
    assert decide(retention(expires_in=-1), node(), Prompt(2000), POLICY, NOW).reason == Reason.EXPIRED
    near = decide(retention(expires_in=9.9), node(), Prompt(2000), POLICY, NOW)
    assert near.reason == Reason.EXPIRED and near.release is not None, "still held: release it"
    assert decide(retention(), node(alive=False), Prompt(2000), POLICY, NOW).reason == Reason.NODE_GONE
    assert decide(retention(), None, Prompt(2000), POLICY, NOW).reason == Reason.NODE_GONE
    assert decide(retention(), node(generation=2), Prompt(2000), POLICY, NOW).reason == Reason.NODE_RESTARTED
    small = decide(retention(num_tokens=63), node(), Prompt(2000), POLICY, NOW)
    assert small.reason == Reason.BELOW_THRESHOLD and small.release is not None
    assert decide(retention(num_tokens=64), node(), Prompt(2000), POLICY, NOW).pull


def test_dead_retentions_get_no_release() -> None:
    for d in (
        decide(retention(expires_in=-1), node(), Prompt(2000), POLICY, NOW),
        decide(retention(), node(alive=False), Prompt(2000), POLICY, NOW),
        decide(retention(), node(generation=3), Prompt(2000), POLICY, NOW),
    ):
        assert not d.pull and d.release is None and d.params is None


def test_prefix_verification() -> None:
    seq = list(range(1000))
    same = decide(
        retention(seq=seq), node(), Prompt(1200, block_digests(seq + [5] * 200, 16, SEED)), POLICY, NOW
    )
    # 62 full blocks verified (992 tokens); D's partial last block cannot be verified.
    assert same.pull and same.reusable_tokens == 992
    edited = seq[:300] + [7] * 900
    part = decide(retention(seq=seq), node(), Prompt(1200, block_digests(edited, 16, SEED)), POLICY, NOW)
    assert part.reason == Reason.PARTIAL_PULL and part.reusable_tokens == 288
    none = decide(retention(seq=seq), node(), Prompt(1200, block_digests([9] * 1200, 16, SEED)), POLICY, NOW)
    assert none.reason == Reason.PREFIX_MISMATCH and none.release is not None
    few = seq[:40] + [7] * 900
    low = decide(retention(seq=seq), node(), Prompt(940, block_digests(few, 16, SEED)), POLICY, NOW)
    assert low.reason == Reason.BELOW_THRESHOLD


def test_other_model_never_matches() -> None:
    seq = list(range(1000))
    other = block_digests(seq, 16, seed("other-model"))
    d = decide(retention(seq=seq), node(), Prompt(1000, other), POLICY, NOW)
    assert d.reason == Reason.PREFIX_MISMATCH


def test_release_params_free_without_pulling() -> None:
    r = handout_of(d_params("d-1", 100), RELEASE)
    assert r["remote_num_tokens"] == 0 and r["do_remote_decode"] is True and r["remote_block_ids"]


def test_flat_block_id_lists_of_older_releases() -> None:
    params = d_params("d-1", 100)
    params["remote_block_ids"] = list(range(7))
    assert handout_of(params, Handout(33, 3))["remote_block_ids"] == [0, 1, 2]


def test_param_problems_name_the_field() -> None:
    assert param_problems(d_params("d", 100), 100, 16) == []
    p = d_params("d", 100)
    del p["remote_host"]
    p["remote_port"] = 70000
    problems = " ".join(param_problems(p, 100, 16))
    assert "remote_host is required" in problems and "remote_port" in problems
    short = d_params("d", 100)
    short["remote_block_ids"] = [[1, 2]]
    assert "remote_block_ids[0] has 2 blocks" in " ".join(param_problems(short, 100, 16))
    assert "remote_num_tokens" in " ".join(param_problems(d_params("d", 100), 90, 16))
    for bad in ([[0, 1, -2, 3, 4, 5, 6]], [[0, 1, True, 3, 4, 5, 6]], [[0, 1, 2.5, 3, 4, 5, 6]], [["0"] * 7]):
        wrong = {**d_params("d", 100), "remote_block_ids": bad}
        assert "remote_block_ids[0] must be a list of block ids" in " ".join(param_problems(wrong, 100, 16))
    nan = float("nan")
    for extra, where in (
        ({"tp_size": nan}, "kv_transfer_params.tp_size"),
        ({"vendor": {"a": [1.5, float("inf")]}}, "kv_transfer_params.vendor.a[1]"),
        ({"remote_blocks_expiry_time": -float("inf")}, "kv_transfer_params.remote_blocks_expiry_time"),
    ):
        assert param_problems({**d_params("d", 100), **extra}, 100, 16) == [
            f"{where} must be a finite number"
        ]


@given(
    num_tokens=st.integers(1, 4000),
    prompt=st.integers(0, 5000),
    cut=st.integers(0, 5000),
    block_size=st.sampled_from([16, 64, 128, 256]),
    threshold=st.sampled_from([1, 16, 64, 300]),
    d_has_digests=st.booleans(),
)
def test_handed_params_never_cover_unverified_or_missing_tokens(
    num_tokens: int, prompt: int, cut: int, block_size: int, threshold: int, d_has_digests: bool
) -> None:
    """With the prompt's digests given, every token P is handed is verified: blocks larger
    than the threshold, a prompt shorter than one block, D without digests included."""
    d_seq = list(range(num_tokens))
    p_seq = (d_seq[: min(cut, num_tokens)] + [50_000] * prompt)[:prompt]
    held = retention(num_tokens, seq=d_seq if d_has_digests else None, block_size=block_size)
    policy = Policy(recompute_threshold=threshold)
    d = decide(held, node(), Prompt(prompt, block_digests(p_seq, block_size, SEED)), policy, NOW)
    if d.pull:
        assert d_has_digests
        params = handout_of(d_params("d-1", num_tokens, block_size=block_size), d.params)  # type: ignore[arg-type]
        n = params["remote_num_tokens"]
        assert n == d.reusable_tokens >= threshold
        assert n <= min(num_tokens, prompt) and n % block_size == 0
        assert p_seq[:n] == d_seq[:n], "every pulled token is the prompt's own token"
        assert params["remote_block_ids"] == [list(range(100, 100 + n // block_size))]
    else:
        assert d.release == RELEASE  # a live retention claimed and not pulled is freed


def test_a_prompt_shorter_than_one_block_is_never_pulled_unverified() -> None:
    """Blocks of 128 tokens, the default threshold of 64: a 100-token prompt has no full
    block to digest, and its digests are empty, not absent: nothing is verified, nothing
    pulled (it was: 100 tokens of D's first block, whatever the prompt said)."""
    held = retention(1000, seq=list(range(1000)), block_size=128)
    d = decide(held, node(), Prompt(100, b""), POLICY, NOW)
    assert not d.pull and d.reason == Reason.BELOW_THRESHOLD and "shorter than one block" in d.detail


def test_digests_given_for_a_retention_without_any_are_not_pulled() -> None:
    d = decide(retention(1000), node(), Prompt(1200, block_digests(list(range(1200)), 16, SEED)), POLICY, NOW)
    assert not d.pull and d.reason == Reason.UNVERIFIABLE and d.release == RELEASE


def test_digests_beyond_the_prompts_tokens_verify_nothing_more() -> None:
    """Only the prompt's full blocks count, whatever number of digests a caller sends."""
    seq = list(range(1000))
    d = decide(retention(1000, seq=seq), node(), Prompt(500, block_digests(seq, 16, SEED)), POLICY, NOW)
    assert d.pull and d.reusable_tokens == 496  # 31 full blocks of the 500 tokens


def test_blocks_a_kv_cache_group_freed_on_d_are_only_pulled_whole() -> None:
    """A group holding vLLM's null block (a sliding window's freed positions): a pull cut
    short could hand P null blocks where its window needs data. Whole pulls go on."""
    seq = list(range(1008))  # 63 full blocks: a verified pull can take every token
    held = retention(1008, seq=seq, whole_only=True)
    whole = decide(held, node(), Prompt(1200, block_digests(seq + [7] * 192, 16, SEED)), POLICY, NOW)
    assert whole.pull and whole.reusable_tokens == 1008
    edited = seq[:600] + [9] * 600
    cut = decide(held, node(), Prompt(1200, block_digests(edited, 16, SEED)), POLICY, NOW)
    assert not cut.pull and cut.reason == Reason.WHOLE_ONLY and cut.release == RELEASE
    assert not decide(held, node(), Prompt(700), POLICY, NOW).pull  # unverified and short, too
    # D's last block partly filled: its tokens cannot be verified, so no pull takes all of them
    partial = retention(1000, seq=seq[:1000], whole_only=True)
    assert decide(partial, node(), Prompt(1200, block_digests(seq, 16, SEED)), POLICY, NOW).reason == (
        Reason.WHOLE_ONLY
    )


def test_which_params_hold_freed_blocks() -> None:
    assert not holds_null_blocks(d_params("d", 100))
    groups = {**d_params("d", 100), "remote_block_ids": [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 0, 3, 4]]}
    assert holds_null_blocks(groups)
    assert holds_null_blocks({**d_params("d", 100), "remote_block_ids": [0, 1, 2, 3, 4, 5, 6]})


def test_without_the_prompts_digests_the_caller_vouches_for_the_prompt() -> None:
    """No digests given at all (a caller that does not compute them): the pull is
    unverified, as before, whatever D registered."""
    seq = list(range(1000))
    assert decide(retention(1000, seq=seq), node(), Prompt(1200), POLICY, NOW).reusable_tokens == 1000
    assert decide(retention(1000), node(), Prompt(700), POLICY, NOW).reason == Reason.PARTIAL_PULL


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_blocks_is_the_longest_common_prefix(a: list[int], b: list[int]) -> None:
    da, db = block_digests(a, 2, SEED), block_digests(b, 2, SEED)
    n = common_prefix_blocks(da, db)
    assert a[: 2 * n] == b[: 2 * n]
    longer = 2 * (n + 1)
    assert len(a) < longer or len(b) < longer or a[:longer] != b[:longer]
    assert len(da) % DIGEST_SIZE == 0


@given(
    n_blocks=st.integers(1, 50),
    keep=st.one_of(st.none(), st.integers(0, 60)),
    tokens=st.integers(0, 800),
    flat=st.booleans(),
)
def test_a_handout_sets_the_flags_and_cuts_every_group(
    n_blocks: int, keep: int | None, tokens: int, flat: bool
) -> None:
    params = d_params("d-1", n_blocks * 16)
    if flat:
        params["remote_block_ids"] = params["remote_block_ids"][0]
    ids = params["remote_block_ids"]
    if keep is not None:
        ids = ids[:keep] if flat else [g[:keep] for g in ids]
    expected = {
        **params,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_num_tokens": tokens,
        "remote_block_ids": ids,
    }
    assert handout_of(params, Handout(tokens, keep)) == expected


def test_a_claim_marker_says_expired_once_its_retentions_deadline_passed() -> None:
    taken = decide_claimed(Claim(claimed_at=NOW - 3), NOW)
    assert (taken.pull, taken.reason) == (False, Reason.ALREADY_CLAIMED)  # (deadline not known)
    before = decide_claimed(Claim(claimed_at=NOW - 3, expires_at=NOW + 2), NOW)
    assert before.reason == Reason.ALREADY_CLAIMED
    after = decide_claimed(Claim(claimed_at=NOW - 3, expires_at=NOW - 1), NOW)
    assert (after.pull, after.reason, after.release) == (False, Reason.EXPIRED, None)


def test_the_proto_documents_exactly_the_lookup_reasons() -> None:
    """LookupResponse.reason's comment in leases.proto is the API's list of reasons: every
    Reason, in order, and nothing else (it listed 12 of 14)."""
    proto = Path(controlplane.__file__).parent.parent / "proto" / "kvferry" / "v1" / "leases.proto"
    text = proto.read_text()
    message = text[text.index("message LookupResponse {") :]
    comment = message[: message.index("string reason = 2;")]
    listed = re.findall(r"^\s*//\s+- (\w+):", comment, re.MULTILINE)
    assert listed == [r.value for r in Reason]

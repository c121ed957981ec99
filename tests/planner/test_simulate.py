"""The event simulation: what a TTL, threshold, budget and policy do to reuse and D's memory."""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.costs import CostModel
from planner.simulate import Config, simulate
from planner.traces import Measured, Turn, Workload

FREE = CostModel(0.0, 0.0, 0.0, 0.0, 16)
"""Engines that take no time: only the think times set the clock."""


def _conversation(cid: str, turns: int, gap_s: float, start: float = 0.0, grow: int = 1600) -> list[Turn]:
    out: list[Turn] = []
    prompt = grow
    for i in range(turns):
        shared = 0 if i == 0 else out[-1].prompt_tokens + out[-1].output_tokens
        out.append(
            Turn(cid, i, prompt, 16, shared, start if i == 0 else None, None, None if i == 0 else gap_s)
        )
        prompt = shared + grow if i else prompt + 16 + grow
    return out


def _timed(*convs: list[Turn]) -> Workload:
    return Workload(tuple(t for c in convs for t in c), "test", timed=True)


def test_a_turn_within_the_ttl_pulls_the_previous_turns_whole_blocks() -> None:
    out = simulate(_timed(_conversation("a", 3, 30.0)), Config(ttl_s=480, pool_blocks=10_000), FREE)
    assert [r.decision for r in out.turns] == ["RECOMPUTE", "PULL", "PULL"]
    assert out.turns[1].reused_tokens == 1616  # 1600 + 16, whole blocks of 16
    assert out.hit_rate == pytest.approx(2 / 3)
    assert out.releases["claimed"] == 2 and out.releases["expiry"] == 1


def test_a_turn_after_the_ttl_less_the_safety_margin_recomputes() -> None:
    w = _timed(_conversation("a", 2, 115.0))
    assert simulate(w, Config(ttl_s=120, pool_blocks=10_000), FREE).hits == 0  # (5 s before expiry)
    assert simulate(w, Config(ttl_s=130, pool_blocks=10_000), FREE).hits == 1


def test_block_seconds_count_until_the_claim_or_the_expiry() -> None:
    out = simulate(_timed(_conversation("a", 2, 30.0)), Config(ttl_s=100, pool_blocks=10_000), FREE)
    first_blocks = math.ceil((1600 + 16) / 16)
    second_blocks = math.ceil((1600 + 16 + 1600 + 16) / 16)
    assert out.block_seconds == pytest.approx(first_blocks * 30 + second_blocks * 100)
    assert out.block_seconds_per_reused_token == pytest.approx(out.block_seconds / 1616)


def test_reuse_below_the_threshold_recomputes() -> None:
    w = _timed(_conversation("a", 2, 1.0, grow=48))
    assert simulate(w, Config(threshold=80, pool_blocks=10_000), FREE).hits == 0  # (64 reusable)
    assert simulate(w, Config(threshold=64, pool_blocks=10_000), FREE).hits == 1


@pytest.mark.parametrize("policy", ["fixed", "value"])
def test_a_budget_keeps_retentions_under_its_share_of_the_pool(policy: str) -> None:
    # "a" comes back every 10 s, its context growing; "b" ends at once and never comes back.
    w = _timed(_conversation("a", 4, 10.0), _conversation("b", 1, 10.0, start=1.0))
    out = simulate(w, Config(ttl_s=480, budget=0.4, policy=policy, pool_blocks=1000), FREE)
    assert max(held for _, _, held in out.pressure) <= 0.4
    assert out.releases["budget"] >= 1  # (b's, when a's third turn is retained)
    assert out.hits == 3  # a's returns all pulled: b's retention made the room


def test_the_value_policy_makes_room_for_a_request_and_fixed_counts_the_pool_full() -> None:
    a = _conversation("a", 1, 1.0)
    b = _conversation("b", 1, 1.0, start=5.0, grow=3200)
    w = _timed(a, b)
    pool = 220  # a's retention (101 blocks) and b's request (201) do not fit together
    fixed = simulate(w, Config(policy="fixed", pool_blocks=pool), FREE)
    value = simulate(w, Config(policy="value", pool_blocks=pool), FREE)
    assert fixed.pool_full == 1 and value.pool_full == 0
    assert value.releases["near_full"] == 1
    assert max(p for _, p, _ in value.pressure) <= 1.0


def test_ttft_follows_the_cost_model_and_p_queues_one_prefill_at_a_time() -> None:
    costs = CostModel(
        prefill_ms_per_token=0.1, transfer_ms_per_block=1.0, decode_ms_per_token=0, overhead_ms=5
    )
    two = Workload((Turn("a", 0, 1600, 1, 0, 0.0), Turn("b", 0, 1600, 1, 0, 0.0)), "test", timed=True)
    out = simulate(two, Config(reuse=False), costs)
    alone = 5 + 160 + 100  # overhead, prefill of 1600 tokens, D pulling 100 blocks
    assert sorted(r.ttft_ms for r in out.turns) == pytest.approx([alone, alone + 160])


def test_untimed_conversations_run_a_client_at_a_time_after_the_think_time() -> None:
    convs = [t for c in ("a", "b") for t in _conversation(c, 2, 0.0)]
    w = Workload(
        tuple(t.__class__(**{**t.__dict__, "arrival_s": None, "think_s": None}) for t in convs), "t", False
    )
    out = simulate(w, Config(pool_blocks=10_000), CostModel(0.0, 0.0, 1000.0, 0.0), think_s=2.0, clients=1)
    # each turn decodes 16 tokens x 1 s; one client: a0, a1, b0, b1, each 2 s after the last ended
    assert [r.turn.conversation for r in out.turns] == ["a", "a", "b", "b"]
    assert out.hits == 2
    assert out.pressure[-1][0] == pytest.approx(4 * 16 + 3 * 2)


def test_the_simulation_is_deterministic() -> None:
    w = _timed(_conversation("a", 5, 7.0), _conversation("b", 4, 3.0, start=2.0))
    c = Config(ttl_s=60, budget=0.5, policy="value", pool_blocks=900)
    assert simulate(w, c, FREE) == simulate(w, c, FREE)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Config(budget=0.0), "budget must be a share"),
        (Config(policy="lru"), "policy must be one of"),
        (Config(pool_blocks=0), "the pool at least one block"),
    ],
)
def test_a_bad_configuration_is_refused(config: Config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(_timed(_conversation("a", 1, 1.0)), config, FREE)


def test_a_timed_turn_waits_for_its_conversations_previous_answer() -> None:
    # (a Mooncake trace gives arrivals only: a turn stamped before its previous one ended
    # is sent when that answer is in, as a client would)
    costs = CostModel(0.0, 0.0, decode_ms_per_token=100.0, overhead_ms=0.0)
    first = Turn("a", 0, 512, 50, 0, 0.0)  # ends at 5 s
    second = Turn("a", 1, 1024, 10, 562, 1.0)
    out = simulate(Workload((first, second), "t", timed=True), Config(pool_blocks=10_000), costs)
    assert [r.decision for r in out.turns] == ["RECOMPUTE", "PULL"]
    assert out.pressure[-1][0] == pytest.approx(5.0 + 1.0)  # arrived at 5 s, decoded 1 s


def test_idle_release_frees_last_turns_early_at_the_same_hit_rate() -> None:
    """The daemon's idle release (the `idle` policy): once 50 returns were seen, a last
    turn's retention goes after max(2 x their 99th percentile, 10 s), not at its TTL; the
    conversations that do come back within that are still pulled."""
    convs = [_conversation(f"c{i}", 4, 2.0, start=i * 0.5) for i in range(30)]
    w = _timed(*convs)
    fixed = simulate(w, Config(ttl_s=480, pool_blocks=1_000_000), FREE)
    idle = simulate(w, Config(ttl_s=480, policy="idle", pool_blocks=1_000_000), FREE)
    assert idle.hit_rate == fixed.hit_rate == pytest.approx(3 / 4)
    assert idle.releases["idle"] > 0
    assert idle.block_seconds < 0.1 * fixed.block_seconds
    few = simulate(_timed(*convs[:10]), Config(ttl_s=480, policy="idle", pool_blocks=1_000_000), FREE)
    assert few.releases["idle"] == 0  # (30 returns seen: fewer than 50, the rule waits)


def _recorded(
    cid: str,
    index: int,
    prompt: int,
    shared: int,
    at: float,
    think: float | None,
    ttft: float,
    latency: float,
    reused: int = 0,
) -> Turn:
    """A turn of a kvferry trace: its recorded arrival, think time, reuse and timing."""
    decision = "PULL" if reused else "RECOMPUTE"
    return Turn(cid, index, prompt, 16, shared, at, Measured(decision, reused, ttft, latency), think)


def test_a_recorded_turn_keeps_its_lag_so_p_queues_on_the_recorded_timeline() -> None:
    """a#0 ended 724 ms after the model's end for it (a stall: 900 ms against 160 + 16), so
    a#1 arrives when it did, 1.0 s, and its prefill (160 ms) delays b's, which came at
    1.05 s. Without the lag a#1 would come at 0.276 s and b would find P free."""
    costs = CostModel(prefill_ms_per_token=0.1, transfer_ms_per_block=0.0, decode_ms_per_token=1.0)
    workload = _timed(
        [
            _recorded("a", 0, 1600, 0, 0.0, None, 500.0, 900.0),
            _recorded("a", 1, 3216, 1616, 1.0, 0.1, 170.0, 190.0, reused=1616),
        ],
        [_recorded("b", 0, 1600, 0, 1.05, None, 270.0, 290.0)],
    )
    out = simulate(workload, Config(ttl_s=480, pool_blocks=10_000), costs)
    by = {(r.turn.conversation, r.turn.index): r for r in out.turns}
    assert by["a", 1].decision == "PULL"
    assert by["a", 1].ttft_ms == pytest.approx(160.0)
    assert by["b", 0].ttft_ms == pytest.approx(270.0)  # (110 ms behind a#1, then its own 160)


def test_a_turn_recorded_faster_than_the_model_still_follows_its_previous_answer() -> None:
    """a#0 took 50 ms where the model says 176: its lag (-126 ms) is more than the think time
    (100 ms), so a#1 comes at a#0's modelled end, and finds its retention."""
    costs = CostModel(prefill_ms_per_token=0.1, transfer_ms_per_block=0.0, decode_ms_per_token=1.0)
    workload = _timed(
        [
            _recorded("a", 0, 1600, 0, 0.0, None, 40.0, 50.0),
            _recorded("a", 1, 3216, 1616, 0.15, 0.1, 170.0, 190.0, reused=1616),
        ]
    )
    out = simulate(workload, Config(ttl_s=480, pool_blocks=10_000), costs)
    assert [r.decision for r in out.turns] == ["RECOMPUTE", "PULL"]
    assert out.pressure[1][0] == pytest.approx(0.176)  # (a#0's end, then a#1 at once)
    assert out.pressure[2][0] == pytest.approx(0.176)


@pytest.mark.parametrize(("reason", "replayed"), [("daemon_timeout", "SKIPPED"), ("reuse_off", "PULL")])
def test_a_lookup_the_run_skipped_is_skipped_in_the_replay(reason: str, replayed: str) -> None:
    """The router skipped a#1's lookup at its deadline: no retention policy changes that, so
    the replay skips it too, and a#1's retention replaces a#0's, which a#2 then pulls. A turn
    skipped because reuse was off is looked up: the replay decides that."""
    a0 = _recorded("a", 0, 1600, 0, 0.0, None, 160.0, 176.0)
    a1 = _recorded("a", 1, 3216, 1616, 1.0, 0.824, 322.0, 338.0)
    a1 = dataclasses.replace(a1, measured=Measured("SKIPPED", 0, 322.0, 338.0, reason))
    a2 = _recorded("a", 2, 4832, 3232, 2.0, 0.662, 160.0, 176.0, reused=3232)
    costs = CostModel(prefill_ms_per_token=0.1, transfer_ms_per_block=0.0, decode_ms_per_token=1.0)
    out = simulate(_timed([a0, a1, a2]), Config(ttl_s=480, pool_blocks=10_000), costs)
    assert [r.decision for r in out.turns] == ["RECOMPUTE", replayed, "PULL"]
    assert out.turns[2].reused_tokens == 3232
    assert out.releases["replaced"] == (1 if replayed == "SKIPPED" else 0)

"""The retention budget's decision (controlplane.budget): pure, no I/O."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.budget import (
    EDGES,
    IDLE_FLOOR_S,
    IDLE_QUANTILE,
    MIN_OBSERVED,
    PRIOR_P,
    Budget,
    Held,
    IntervalSketch,
    Pool,
    Reason,
    idle,
    idle_after,
    releases,
    value,
)

NOW = 10_000.0

intervals = st.lists(st.floats(min_value=0.0, max_value=20_000.0), max_size=200)


def held(i: int, tokens: int = 1600, left: float = 300.0, age: float = 10.0, block: int = 16) -> Held:
    return Held("t", f"c{i}", tokens, block, NOW - age, NOW + left, revision=i + 1)


@given(intervals, st.floats(0, 5000), st.floats(0, 5000))
def test_p_return_is_a_probability(seen: list[float], age: float, left: float) -> None:
    sketch = IntervalSketch()
    for s in seen:
        sketch.observe(s)
    assert 0.0 <= sketch.p_return(age, left) <= 1.0


@given(intervals, st.floats(0, 3000), st.floats(0, 3000), st.floats(0, 3000))
def test_p_return_grows_with_the_time_left(seen: list[float], age: float, a: float, b: float) -> None:
    sketch = IntervalSketch()
    for s in seen:
        sketch.observe(s)
    lo, hi = sorted((a, b))
    assert sketch.p_return(age, lo) <= sketch.p_return(age, hi) + 1e-9


def test_p_return_learns_the_intervals() -> None:
    sketch = IntervalSketch()
    assert 0.0 < sketch.p_return(0, 480) < PRIOR_P  # nothing seen: the prior
    for _ in range(1000):
        sketch.observe(30.0)
    assert sketch.p_return(0, 60) > 0.95  # turns come back after 30 s
    assert sketch.p_return(100, 300) < 0.15  # idle 100 s: it is not coming back
    for _ in range(1000):
        sketch.never()
    assert 0.4 < sketch.p_return(0, 60) < 0.6  # half of them ended


def test_p_return_is_zero_with_no_time_left() -> None:
    assert IntervalSketch().p_return(5, 0) == 0.0


def test_value_is_per_block_second() -> None:
    sketch = IntervalSketch()
    small, big = held(0, tokens=160), held(1, tokens=1600)
    # Same tokens per block, same time left: the same value per block-second.
    assert math.isclose(value(small, NOW, sketch), value(big, NOW, sketch))
    assert value(held(2, left=-1), NOW, sketch) == 0.0


held_sets = st.lists(
    st.tuples(st.integers(1, 4000), st.floats(1, 480), st.floats(0, 480)), min_size=0, max_size=40
)


@given(held_sets, st.integers(1, 10_000), st.floats(0, 1), st.floats(0.05, 1), st.floats(0.05, 1), intervals)
def test_releases_bring_the_node_under_its_limits(
    specs: list[tuple[int, float, float]],
    pool_blocks: int,
    usage: float,
    share: float,
    near_full: float,
    seen: list[float],
) -> None:
    sketch = IntervalSketch()
    for s in seen:
        sketch.observe(s)
    hs = [held(i, tokens=t, left=left, age=age) for i, (t, left, age) in enumerate(specs)]
    pool, budget = Pool(pool_blocks, usage), Budget(share, near_full)
    out = releases(pool, hs, budget, NOW, sketch)
    chosen = [h for h, _ in out]
    assert len({h.conversation_id for h in chosen}) == len(chosen)  # each once
    freed = sum(h.blocks for h in chosen)
    retained = sum(h.blocks for h in hs)
    over_budget = retained - math.floor(share * pool_blocks)
    over_full = round(usage * pool_blocks) - math.floor(near_full * pool_blocks) if near_full < 1 else 0
    assert freed >= min(max(over_budget, over_full, 0), retained)  # enough, when it can be
    if chosen:  # and no more than needed: without the last one it was not enough
        assert freed - chosen[-1].blocks < max(over_budget, over_full)
    # The least valuable go first.
    values = [value(h, NOW, sketch) for h in chosen]
    kept = [value(h, NOW, sketch) for h in hs if h not in chosen]
    if values and kept:
        assert max(values) <= min(kept) + 1e-12
    # Budget reasons first, then near_full.
    reasons = [r for _, r in out]
    assert reasons == sorted(reasons, key=lambda r: r is Reason.NEAR_FULL)


def test_nothing_is_released_under_the_budget_or_with_the_pool_unknown() -> None:
    sketch = IntervalSketch()
    hs = [held(i) for i in range(10)]  # 100 blocks each: 1,000
    assert releases(Pool(4096, 0.5), hs, Budget(0.5, 0.9), NOW, sketch) == []
    assert releases(Pool(0, 1.0), hs, Budget(0.1, 0.1), NOW, sketch) == []


def test_over_budget_releases_the_least_valuable_first() -> None:
    sketch = IntervalSketch()
    for _ in range(100):
        sketch.observe(20.0)
    fresh = held(0, age=5)  # likely to come back
    stale = held(1, age=400, left=60)  # idle long past every interval seen
    out = releases(Pool(300, 0.2), [fresh, stale], Budget(0.5, 0.9), NOW, sketch)
    assert out == [(stale, Reason.BUDGET)]


def test_a_near_full_pool_releases_retentions_first() -> None:
    hs = [held(i) for i in range(5)]  # 500 blocks, within a 0.5 budget of 4096
    out = releases(Pool(4096, 0.95), hs, Budget(0.5, 0.9), NOW, IntervalSketch())
    # 95% of 4,096 used, the mark at 3,686: 206 blocks to free, 3 retentions of 100.
    assert [r for _, r in out] == [Reason.NEAR_FULL] * 3


def test_expired_retentions_are_not_released() -> None:
    out = releases(Pool(100, 1.0), [held(0, left=-5)], Budget(0.1, 0.5), NOW, IntervalSketch())
    assert out == []


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, math.nan])
def test_a_budget_outside_the_pool_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="retention budget must be a share of the pool in"):
        Budget(share, 0.9).validate()


# -- the idle release -------------------------------------------------------------------------


def sketch_of(seen: list[float]) -> IntervalSketch:
    sketch = IntervalSketch()
    for s in seen:
        sketch.observe(s)
    return sketch


@given(st.lists(st.floats(0.0, 7000.0), min_size=1, max_size=300), st.floats(0.0, 1.0))
def test_the_quantile_is_a_bucket_edge_at_or_above_that_share_of_the_intervals(
    seen: list[float], q: float
) -> None:
    sketch = sketch_of(seen)
    edge = sketch.quantile(q)
    assert edge in EDGES
    assert sum(s <= edge for s in seen) >= q * len(seen)


def test_the_quantile_of_nothing_seen_is_zero() -> None:
    assert IntervalSketch().quantile(0.99) == 0.0
    sketch = IntervalSketch()
    sketch.never()  # (conversations that never came back are no interval)
    assert sketch.quantile(0.5) == 0.0


@given(
    st.lists(st.floats(0.0, 600.0), max_size=200),
    st.lists(st.tuples(st.floats(0.0, 2000.0), st.floats(-50.0, 480.0)), max_size=40),
    st.floats(0.0, 5.0),
)
def test_idle_releases_exactly_the_live_retentions_idle_past_the_threshold(
    seen: list[float], specs: list[tuple[float, float]], factor: float
) -> None:
    sketch = sketch_of(seen)
    hs = [held(i, age=age, left=left) for i, (age, left) in enumerate(specs)]
    out = idle(hs, NOW, sketch, factor)
    after = idle_after(sketch, factor)
    if factor == 0 or len(seen) < MIN_OBSERVED:
        assert after is None and out == []  # off, or too little seen: the fixed TTL
        return
    assert after is not None
    assert after >= IDLE_FLOOR_S
    assert after >= factor * sketch.quantile(IDLE_QUANTILE)
    assert set(out) == {h for h in hs if h.expires_at > NOW and NOW - h.created_at > after}
    assert [h.created_at for h in out] == sorted(h.created_at for h in out)  # oldest first


def test_a_conversation_idle_far_past_every_interval_seen_is_released() -> None:
    sketch = sketch_of([30.0] * MIN_OBSERVED)  # turns come back after 30 s
    q = sketch.quantile(IDLE_QUANTILE)
    assert 30.0 <= q < 40.0  # (the bucket's upper edge)
    fresh, paused, gone = held(0, age=40), held(1, age=2 * q - 1), held(2, age=2 * q + 1)
    assert idle([fresh, paused, gone], NOW, sketch, 2.0) == [gone]
    assert idle([gone], NOW, sketch, 0.0) == []  # --idle-release 0: held to its deadline
    # One interval fewer: too little seen to tell.
    assert idle([gone], NOW, sketch_of([30.0] * (MIN_OBSERVED - 1)), 2.0) == []


def test_quick_turns_still_leave_the_floor() -> None:
    sketch = sketch_of([0.2] * 200)
    assert idle_after(sketch, 2.0) == IDLE_FLOOR_S
    assert idle([held(0, age=IDLE_FLOOR_S - 1)], NOW, sketch, 2.0) == []
    assert idle([held(1, age=IDLE_FLOOR_S + 1)], NOW, sketch, 2.0) != []


@pytest.mark.parametrize("factor", [-1.0, math.nan, math.inf])
def test_an_idle_factor_below_zero_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="idle release factor must be 0 \\(off\\) or positive, not"):
        Budget(0.5, 0.9, factor).validate()


def test_a_held_retention_is_no_work_for_the_garbage_collector() -> None:
    """A replica holds one per live retention of its nodes, and a gauge scan makes one per
    retention in etcd: untracked, no collection walks them."""
    import gc

    assert not gc.is_tracked(held(1))

"""Folding KV events into net-effect batches, and what a seq number means. Pure."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kvevents import Cleared, KvEvent, Removed, Stored
from sidecar.kvindex import DUPLICATE_SPAN, KvBatch, KvMirror, SeqTracker, Verdict, replay_outcome


def daemon_apply(index: set[int], batches: list[KvBatch]) -> set[int]:
    """What the daemon does with Attach kv_events (KvEventBatch semantics)."""
    for b in batches:
        assert not set(b.stored) & set(b.removed), "stored and removed must be disjoint"
        if b.reset or b.cleared:
            index = set()
        index -= set(b.removed)
        index |= set(b.stored)
    return index


def test_first_drain_is_a_reset_then_deltas() -> None:
    m = KvMirror()
    m.apply([Stored([1, 2, 3])], seq=0)
    (first,) = m.drain()
    assert first.reset and sorted(first.stored) == [1, 2, 3] and first.seq == 0
    assert m.drain() == []
    m.apply([Removed([2]), Stored([4])], seq=1)
    (delta,) = m.drain()
    assert not delta.reset and delta.stored == [4] and delta.removed == [2] and delta.seq == 1


def test_store_then_remove_within_a_window_cancels_out() -> None:
    m = KvMirror()
    m.drain()
    m.apply([Stored([5, 6])])
    m.apply([Removed([5])])
    (b,) = m.drain()
    assert b.stored == [6] and b.removed == []


def test_remove_store_remove_within_a_window_is_a_removal() -> None:
    m = KvMirror()
    m.apply([Stored([0])])
    m.drain()  # the daemon has 0
    m.apply([Removed([0]), Stored([0]), Removed([0])])
    (b,) = m.drain()
    assert b.removed == [0] and b.stored == []


def test_a_hash_cached_twice_stays_until_both_copies_go() -> None:
    m = KvMirror()
    m.drain()
    m.apply([Stored([9]), Stored([9])])
    m.drain()
    m.apply([Removed([9])])
    assert 9 in m and m.drain() == []
    m.apply([Removed([9])])
    assert 9 not in m
    (b,) = m.drain()
    assert b.removed == [9]


def test_cleared_drops_everything_then_what_follows_is_stored() -> None:
    m = KvMirror()
    m.apply([Stored([1, 2])])
    m.drain()
    m.apply([Removed([1]), Cleared(), Stored([3]), Removed([3]), Stored([4])])
    (b,) = m.drain()
    assert b.cleared and b.stored == [4] and b.removed == []


def test_forget_is_a_reset_with_nothing() -> None:
    m = KvMirror()
    m.apply([Stored([1, 2])], seq=7)
    m.drain()
    m.forget()
    (b,) = m.drain()
    assert b.reset and b.stored == [] and len(m) == 0 and b.seq == -1


def test_reset_snapshots_and_big_deltas_are_chunked() -> None:
    m = KvMirror()
    m.apply([Stored(list(range(10)))])
    batches = m.drain(max_hashes=4)
    assert [b.reset for b in batches] == [True, False, False]
    assert sorted(h for b in batches for h in b.stored) == list(range(10))
    m.apply([Removed([0, 1, 2]), Stored([20, 21, 22])])
    batches = m.drain(max_hashes=4)
    assert all(b.size <= 4 for b in batches) and len(batches) == 2
    assert daemon_apply(set(range(10)), batches) == m.hashes()


@st.composite
def engine_runs(draw: st.DrawFn) -> list[list[KvEvent]]:
    """Payloads an engine could publish: removals only of cached copies, clears, duplicates."""
    cached: Counter[int] = Counter()
    payloads: list[list[KvEvent]] = []
    for _ in range(draw(st.integers(1, 12))):
        events: list[KvEvent] = []
        for _ in range(draw(st.integers(0, 6))):
            kind = draw(st.sampled_from(["store", "store", "remove", "clear"] if cached else ["store"]))
            if kind == "store":
                hs = draw(st.lists(st.integers(0, 30), min_size=1, max_size=5))
                cached.update(hs)
                events.append(Stored(hs))
            elif kind == "remove":
                picked = draw(st.lists(st.sampled_from(sorted(cached.elements())), min_size=1, max_size=3))
                removed = []
                for h in picked:  # an engine removes only copies it has
                    if cached[h] > 0:
                        cached[h] -= 1
                        removed.append(h)
                cached = +cached
                events.append(Removed(removed))
            else:
                cached.clear()
                events.append(Cleared())
        payloads.append(events)
    return payloads


@settings(max_examples=300, deadline=None)
@given(
    engine_runs(),
    st.lists(st.booleans(), min_size=12, max_size=12),
    st.integers(1, 8),
    st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_the_daemon_index_always_equals_the_engine_cache(
    payloads: list[list[KvEvent]], drain_after: list[bool], chunk: int, reset_before: list[bool]
) -> None:
    """Whatever the payloads, drains and resets (the Attach stream ended) in between."""
    engine: Counter[int] = Counter()
    m = KvMirror()
    index: set[int] = {999}  # stale state from before: the first batch is a reset
    for i, events in enumerate(payloads):
        for e in events:
            if isinstance(e, Stored):
                engine.update(e.hashes)
            elif isinstance(e, Removed):
                engine.subtract(e.hashes)
            else:
                engine.clear()
        engine += Counter()
        if reset_before[i]:
            m.request_reset()
        m.apply(events, seq=i)
        assert m.hashes() == set(engine)
        if drain_after[i]:
            index = daemon_apply(index, m.drain(max_hashes=chunk))
            assert index == set(engine)
    index = daemon_apply(index, m.drain(max_hashes=chunk))
    assert index == set(engine)


@settings(max_examples=200, deadline=None)
@given(st.lists(engine_runs(), min_size=2, max_size=3), st.data())
def test_data_parallel_ranks_fold_into_their_union(
    runs: list[list[list[KvEvent]]], data: st.DataObject
) -> None:
    """Each rank has its own cache and stream, interleaved at random: the mirror (and the
    daemon's index) is their union, and one rank's clear or removal leaves the others'
    copies of the same hashes."""
    ranks = len(runs)
    caches: list[Counter[int]] = [Counter() for _ in runs]
    m = KvMirror(ranks)
    index: set[int] = set()
    queue = [(rank, events) for rank, run in enumerate(runs) for events in run]
    order = data.draw(st.permutations(range(len(queue))))
    next_of = [0] * ranks  # (a rank's own payloads stay in their order)
    by_rank = [[events for r, events in queue if r == rank] for rank in range(ranks)]
    for i in order:
        rank = queue[i][0]
        events = by_rank[rank][next_of[rank]]
        next_of[rank] += 1
        for e in events:
            if isinstance(e, Stored):
                caches[rank].update(e.hashes)
            elif isinstance(e, Removed):
                caches[rank].subtract(e.hashes)
            else:
                caches[rank].clear()
        caches[rank] += Counter()
        m.apply(events, seq=next_of[rank], rank=rank)
        union = set().union(*caches)
        assert m.hashes() == union
        if data.draw(st.booleans()):
            index = daemon_apply(index, m.drain())
            assert index == union
    m.forget()
    assert not m.hashes() and all(not mine.present and not mine.extra for mine in m._ranks or ())


def test_one_ranks_clear_leaves_the_other_ranks_blocks() -> None:
    m = KvMirror(2)
    m.apply([Stored([1, 2])], seq=5, rank=0)
    m.apply([Stored([2, 3])], seq=9, rank=1)
    assert m.hashes() == {1, 2, 3} and m.seq == 5  # (rank 0's seq is the one told)
    m.drain()
    m.apply([Removed([1])], rank=1)  # not rank 1's: nothing leaves
    m.apply([Cleared()], rank=1)
    assert m.hashes() == {1, 2}
    (b,) = m.drain()
    assert b.removed == [3] and not b.cleared and not b.stored


def test_no_delta_piles_up_while_a_reset_is_pending() -> None:
    """Not attached (daemon down for long): the next drain sends a snapshot anyway, so
    events meanwhile leave no per-hash bookkeeping behind, only the mirror itself."""
    m = KvMirror()
    m.apply([Stored([1, 2])])
    m.drain()
    m.apply([Removed([1])])
    m.request_reset()
    for i in range(1000):
        m.apply([Stored([100 + i]), Removed([100 + i])])
    assert m.pending == 1 and len(m._baseline) == 0  # (the window state itself)
    (b,) = m.drain()
    assert b.reset and b.stored == [2]


def test_seq_tracker_in_order_gap_restart() -> None:
    t = SeqTracker()
    assert t.classify(0, now=0.0) is Verdict.APPLY
    t.applied(0)
    assert t.classify(1, 0.0) is Verdict.APPLY
    t.applied(1)
    assert t.classify(5, 0.0) is Verdict.GAP and t.expected == 2
    assert t.classify(0, 0.0) is Verdict.RESTART
    t.restart()
    assert t.expected == 0 and t.classify(0, 0.0) is Verdict.APPLY


def test_seq_tracker_skips_what_a_replay_already_covered() -> None:
    t = SeqTracker(expected=3, overlap_s=2.0)
    t.replayed(9, now=10.0)  # folded 3..9 from the replay
    assert t.expected == 10
    assert t.classify(4, 10.5) is Verdict.DUPLICATE  # queued on SUB before the replay answered
    assert t.classify(10, 10.6) is Verdict.APPLY
    t.applied(10)
    assert t.classify(0, 10.7) is Verdict.RESTART  # in order again: back at 0 is a new engine
    t2 = SeqTracker(expected=3)
    t2.replayed(None, now=0.0)
    assert t2.expected == 3 and t2.classify(0, 5.0) is Verdict.RESTART  # overlap window over


@pytest.mark.parametrize(
    ("expected", "seq", "verdict"),
    [
        (11, 10, Verdict.DUPLICATE),  # the batch just folded in, delivered again
        (11, 4, Verdict.DUPLICATE),  # a little below: seen again (no replay window open)
        (1, 0, Verdict.DUPLICATE),  # batch 0, the only one folded in, again
        (11, 0, Verdict.RESTART),  # back at the start: vLLM numbers from 0 per process
        (5000, 5000 - DUPLICATE_SPAN, Verdict.DUPLICATE),
        (5000, 4999 - DUPLICATE_SPAN, Verdict.RESTART),  # far back: not one seen again
        (11, 11, Verdict.APPLY),
        (11, 12, Verdict.GAP),
    ],
)
def test_seq_tracker_tells_a_duplicate_from_a_restart(expected: int, seq: int, verdict: Verdict) -> None:
    """A seq at or a little below the last one seen, out of any replay's window, is a
    duplicate (it was taken for a restart: the node's generation bumped, every retention
    of D voided); a restart is the seq going back to the start."""
    assert SeqTracker(expected=expected).classify(seq, now=100.0) is verdict


def test_seq_tracker_skip_to_gives_up_on_the_missing() -> None:
    t = SeqTracker(expected=2)
    t.skip_to(8)
    assert t.classify(8, 0.0) is Verdict.APPLY


def test_replay_outcome() -> None:
    assert replay_outcome(5, [])
    assert replay_outcome(5, [5, 6, 7])
    assert not replay_outcome(5, [6, 7])  # the engine's buffer no longer reaches back
    assert not replay_outcome(0, [0, 2])

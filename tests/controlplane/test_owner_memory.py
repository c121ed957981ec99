"""The shard owner's decisions in memory (controlplane.owners.memory, shards): pure, no I/O."""

from __future__ import annotations

from controlplane.owners.memory import Conversation, ShardMemory, Target, Write
from controlplane.owners.shards import fair_share
from controlplane.records import Claim, Retention
from controlplane.validity import valid_until
from kvferry.shards import shard_of

C = Conversation("t", "c")


def retention(request_id: str = "r1", expires_at: float = 1000.0) -> Retention:
    return Retention("d-1", 1, b"{}", 64, 16, 0.0, expires_at, request_id=request_id)


def test_a_conversations_shard_is_stable_and_in_range() -> None:
    shards = {shard_of("t", f"c{i}", 32) for i in range(500)}
    assert shards == set(range(32))  # (spread over every shard)
    assert shard_of("t", "c1", 32) == shard_of("t", "c1", 32)
    assert shard_of("a/b", "c", 32) == shard_of("a/b", "c", 32)


def test_the_fair_share_rounds_up_and_a_lone_replica_owns_all() -> None:
    assert fair_share(32, 1) == 32
    assert fair_share(32, 3) == 11
    assert fair_share(32, 0) == 32


def test_validity_ends_a_margin_before_the_lease_could_lapse() -> None:
    assert valid_until(sent_at=100.0, ttl_s=3, margin_s=0.5) == 102.5


def test_a_claim_takes_the_retention_once_and_leaves_a_marker() -> None:
    m = ShardMemory(marker_s=600)
    r = retention()
    m.put(C, r)
    got, writes = m.claim(C, 10.0, "turn-2", marker=7)
    assert got.taken is r and got.marker_revision == 7
    assert [(w.target, w.value is None) for w in writes] == [(Target.RETENTION, True), (Target.MARKER, False)]
    again, none = m.claim(C, 11.0, "turn-3", marker=8)
    assert again.taken is None and again.earlier == Claim(claimed_at=10.0, claimed_by="turn-2")
    assert none == []


def test_a_registration_says_what_it_replaced_only_when_unclaimed() -> None:
    m = ShardMemory(marker_s=600)
    first, second, third = retention("r1"), retention("r2"), retention("r3")
    assert m.put(C, first)[0] is None
    assert m.put(C, second)[0] is first
    m.claim(C, 10.0, "x", marker=1)
    replaced, writes = m.put(C, third)
    assert replaced is None
    assert writes == [Write(Target.RETENTION, C, third, third.expires_at)]


def test_a_put_back_needs_the_same_marker_and_no_newer_retention() -> None:
    m = ShardMemory(marker_s=600)
    r = retention()
    m.put(C, r)
    m.claim(C, 10.0, "x", marker=1)
    assert m.unclaim(C, r, marker=2, now=11.0) is None  # (another claim's marker)
    assert m.unclaim(C, r, marker=1, now=2000.0) is None  # (past its deadline)
    assert m.unclaim(C, r, marker=1, now=11.0) is not None
    assert m.read(C, 11.0)[0] is not None and m.read(C, 11.0)[1] is None
    m.claim(C, 12.0, "y", marker=3)
    m.put(C, retention("r2"))
    assert m.unclaim(C, r, marker=3, now=13.0) is None  # (a newer turn registered)


def test_a_budget_release_takes_only_the_revision_decided_on() -> None:
    m = ShardMemory(marker_s=600)
    r = retention()
    _, writes = m.put(C, r)
    assert m.revoke_exact(C, 5)[0] is None  # (not written yet: no revision)
    m.written(writes, 5)
    assert m.revoke_exact(C, 4)[0] is None
    assert m.revoke_exact(C, 5)[0] is r
    assert m.revoke_exact(C, 5)[0] is None


def test_markers_and_retentions_are_forgotten_past_their_keep() -> None:
    m = ShardMemory(marker_s=60)
    m.put(Conversation("t", "old"), retention(expires_at=50.0))
    m.put(C, retention())
    m.claim(C, 10.0, "x", marker=1)
    assert m.read(C, 69.0)[1] is not None
    assert m.read(C, 71.0)[1] is None  # (a marker past its keep says nothing)
    m.sweep(now=100.0, slack_s=10.0)
    assert not m.retentions and not m.markers


def test_a_revoke_takes_the_marker_too() -> None:
    m = ShardMemory(marker_s=600)
    r = retention()
    m.put(C, r)
    m.claim(C, 10.0, "x", marker=1)
    held, writes = m.revoke(C)
    assert held is None and len(writes) == 2  # (the marker goes: a put-back now fails)
    assert m.unclaim(C, r, marker=1, now=11.0) is None


def test_a_lazy_shard_reads_a_conversation_once_then_decides_in_memory() -> None:
    from controlplane.owners.memory import Held

    m = ShardMemory(marker_s=600, stored={C})
    r = retention()
    assert m.needs(C) and not m.needs(Conversation("t", "new"))  # (etcd has nothing of a new one)
    m.learn(C, Held(r, 9), None)
    assert not m.needs(C) and m.read(C, 1.0)[0] is not None
    m.learn(C, None, None)  # (a second read, late: memory already decided on it)
    assert m.retentions[C].retention is r
    got, _ = m.claim(C, 10.0, "x", marker=1)
    assert got.taken is r


def test_a_late_put_back_does_not_bring_back_what_a_budget_release_replaced() -> None:
    """X claimed by a lookup that went away; Y registered, then released by the budget:
    X's late put-back must fail (main's a5bde6a, found by the history checker)."""
    m = ShardMemory(marker_s=600)
    x, y = retention("x"), retention("y")
    m.put(C, x)
    m.claim(C, 10.0, "turn-2", marker=1)
    _, writes = m.put(C, y)
    m.written(writes, 7)
    assert m.revoke_exact(C, 7)[0] is y
    assert m.unclaim(C, x, marker=1, now=11.0) is None
    assert m.read(C, 11.0) == (None, None)


def test_what_memory_holds_per_conversation_is_no_work_for_the_garbage_collector() -> None:
    """An owner holds a Held per live conversation and a Marked per recent claim: 100,000s.
    Tracked by the cyclic collector, a full collection walked them all (100+ ms with 120k
    retentions, stalling every lookup); untracked, it walks none of them."""
    import gc

    m = ShardMemory(marker_s=600)
    m.put(C, retention())
    m.put(Conversation("t", "d"), retention("r2"))
    m.claim(Conversation("t", "d"), 10.0, "x", marker=1)
    assert not gc.is_tracked(m.retentions[C])
    assert not gc.is_tracked(m.markers[Conversation("t", "d")])


def test_an_owners_maps_stay_untracked_as_conversations_come_and_go() -> None:
    """A collection untracks a map that holds nothing tracked; a tracked key put in again
    tracked it, in the youngest generation, and the next collections walked all of it
    (20-100 ms with 100,000 entries, every few seconds). Its keys are untracked too."""
    import gc

    m = ShardMemory(marker_s=600)
    for i in range(3):
        m.put(Conversation("t", f"c{i}"), retention(f"r{i}"))
    m.claim(Conversation("t", "c0"), 10.0, "x", marker=1)
    gc.collect()
    m.put(Conversation("t", str(7)), retention("fresh"))  # (a key made at run time)
    m.claim(Conversation("t", "c1"), 11.0, "x", marker=2)
    assert not gc.is_tracked(m.retentions) and not gc.is_tracked(m.markers)
    assert not gc.is_tracked(Conversation("t", str(8)))

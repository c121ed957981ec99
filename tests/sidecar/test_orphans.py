"""The orphan book's decisions (pure): which dropped drafts' blocks are released, which only
counted, and how long each is shown."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.orphans import (
    COUNTED,
    GONE,
    MAX_RELEASE_TRIES,
    RELEASED,
    OrphanBook,
    Pin,
    blocks_of,
    orphan_decision,
)
from sidecar.unretained import STREAM_WITHOUT_PARAMS, UnretainedLedger

REASONS = sorted(RELEASED | COUNTED | GONE)


def _params(rid: str) -> dict[str, Any]:
    return {
        "remote_engine_id": "d",
        "remote_request_id": rid,
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "remote_num_tokens": 0,
    }


def _pin(reason: str, rid: str = "r", *, conv: str = "c", expires_at: float = 100.0, epoch: int = 0) -> Pin:
    return Pin(("acme", conv), _params(rid), 4, expires_at, epoch, reason)


@pytest.mark.parametrize(
    ("reason", "decision"),
    [
        ("overflow", "release"),
        ("shutdown", "release"),
        ("superseded", "release"),
        ("attempts", "release"),
        ("failed", "release"),
        ("maybe_stored", "count"),
        ("cancelled", "count"),
        ("expired", "gone"),
        ("restarted", "gone"),
        ("a reason not known yet", "count"),  # (released only when proven safe)
    ],
)
def test_each_drop_reason_is_released_counted_or_gone(reason: str, decision: str) -> None:
    assert orphan_decision(reason) == decision


def test_a_released_pin_waits_for_room_and_is_shown_until_taken() -> None:
    book = OrphanBook()
    for rid in ("a", "b", "c"):
        assert book.dropped(_pin("overflow", rid), now=10.0) == "release"
    assert book.blocks(10.0) == {"overflow": 12} and book.waiting == 3
    taken = book.take(10.0, room=2)
    assert [p.params["remote_request_id"] for p in taken] == ["a", "b"]
    assert book.take(10.0, room=0) == [] and book.blocks(10.0) == {"overflow": 4}
    assert [p.params["remote_request_id"] for p in book.take(10.0, room=5)] == ["c"]
    assert book.total(10.0) == 0


def test_a_waiting_release_d_freed_meanwhile_or_of_a_process_gone_is_forgotten() -> None:
    book = OrphanBook()
    book.dropped(_pin("overflow", "soon", expires_at=20.0), now=10.0)
    book.dropped(_pin("overflow", "later", expires_at=90.0), now=10.0)
    assert book.take(30.0, room=5) == [_pin("overflow", "later", expires_at=90.0)]
    book.dropped(_pin("shutdown", "old"), now=10.0)
    book.restart(1)
    assert book.take(10.0, room=5) == [] and book.total(10.0) == 0


def test_a_pin_already_freed_or_of_another_process_is_gone() -> None:
    book = OrphanBook()
    assert book.dropped(_pin("overflow", expires_at=5.0), now=10.0) == "gone"
    assert book.dropped(_pin("maybe_stored", epoch=3), now=10.0) == "gone"
    assert book.dropped(_pin("expired"), now=10.0) == "gone"
    assert book.total(10.0) == 0


def test_a_counted_pin_is_shown_until_ds_ttl() -> None:
    book = OrphanBook()
    assert book.dropped(_pin("maybe_stored", expires_at=50.0), now=10.0) == "count"
    assert book.dropped(_pin("cancelled", "r2", expires_at=70.0), now=10.0) == "count"
    assert book.take(10.0, room=10) == []
    assert book.blocks(49.0) == {"maybe_stored": 4, "cancelled": 4}
    assert book.blocks(60.0) == {"cancelled": 4}
    assert book.total(80.0) == 0


def test_params_that_name_no_holder_are_counted_under_their_reason() -> None:
    book = OrphanBook()
    pin = Pin(("acme", "c"), {"remote_num_tokens": 0}, 2, 100.0, 0, "overflow", notifiable=False)
    assert book.dropped(pin, now=10.0) == "count"
    assert book.take(10.0, room=5) == [] and book.blocks(10.0) == {"overflow": 2}


def test_a_later_registration_handing_back_the_same_d_request_resolves_a_counted_pin() -> None:
    book = OrphanBook()
    book.dropped(_pin("maybe_stored", "r1"), now=10.0)
    book.dropped(_pin("maybe_stored", "r1", conv="other"), now=10.0)
    assert book.resolved(("acme", "c"), _params("r2")) == []  # (another D request)
    assert book.resolved(("acme", "c"), None) == []
    gone = book.resolved(("acme", "c"), _params("r1"))
    assert [p.conversation for p in gone] == [("acme", "c")]
    assert book.blocks(10.0) == {"maybe_stored": 4}  # the other conversation's stays


@given(
    st.lists(
        st.tuples(st.sampled_from(REASONS), st.integers(0, 1), st.floats(0, 200), st.integers(0, 8)),
        max_size=40,
    )
)
def test_a_pin_a_retention_may_name_is_never_released(drops: list[tuple[str, int, float, int]]) -> None:
    """Whatever is dropped, in any order, `take` hands out only pins stored nowhere, of the
    current engine process, unexpired, each once."""
    book = OrphanBook()
    released: list[str] = []
    for i, (reason, epoch, expires_at, room) in enumerate(drops):
        book.dropped(_pin(reason, str(i), expires_at=expires_at, epoch=epoch), now=50.0)
        for pin in book.take(50.0, room):
            assert pin.reason in RELEASED and pin.epoch == 0 and pin.expires_at > 50.0
            released.append(pin.params["remote_request_id"])
    assert len(released) == len(set(released))
    counted = sum(1 for reason, epoch, exp, _ in drops if reason in COUNTED and epoch == 0 and exp > 50.0)
    assert book.blocks(50.0).keys() <= set(RELEASED | COUNTED)
    assert sum(book.blocks(50.0).get(r, 0) for r in COUNTED) == 4 * counted


def test_the_ledger_shows_uncaptured_turns_and_orphans_together() -> None:
    ledger = UnretainedLedger(ttl_s=10.0)
    ledger.add(0, 5, finished_at=1.0)
    ledger.orphans.dropped(_pin("maybe_stored", expires_at=1000.0), now=500.0)
    assert ledger.by_reason(2.0, wall=500.0) == {STREAM_WITHOUT_PARAMS: 5, "maybe_stored": 4}
    assert ledger.blocks(2.0, wall=500.0) == 9
    assert ledger.blocks(12.0, wall=1001.0) == 0
    ledger.orphans.dropped(_pin("cancelled", expires_at=2000.0), now=1500.0)
    ledger.restart(1)  # a new engine process: every pin went with the old one
    assert ledger.blocks(12.0, wall=1500.0) == 0


def test_blocks_of_a_draft() -> None:
    assert (blocks_of(33, 16), blocks_of(32, 16), blocks_of(0, 16), blocks_of(10, 0)) == (3, 2, 0, 0)


def test_a_release_that_did_not_take_waits_again_a_few_times_then_is_counted() -> None:
    book = OrphanBook()
    book.dropped(_pin("overflow"), now=10.0)
    for _ in range(MAX_RELEASE_TRIES - 1):
        (pin,) = book.take(10.0, room=1)
        assert book.unreleased(pin, "no_prefill", now=10.0) == "release"
    (pin,) = book.take(10.0, room=1)
    assert book.unreleased(pin, "failed", now=10.0) == "count"
    assert book.take(10.0, room=1) == [] and book.blocks(10.0) == {"overflow": 4}
    assert book.total(200.0) == 0


def test_a_release_a_p_refused_is_counted_and_one_cut_short_is_gone() -> None:
    book = OrphanBook()
    assert book.unreleased(_pin("overflow"), "refused", now=10.0) == "count"
    assert book.unreleased(_pin("overflow", "b"), "cancelled", now=10.0) == "gone"
    assert book.unreleased(_pin("overflow", "c", expires_at=5.0), "failed", now=10.0) == "gone"
    assert book.blocks(10.0) == {"overflow": 4}

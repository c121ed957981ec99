"""The figures the fault suite measures for each fault, and the table it prints.

Pure: turns and the ledger in, numbers out.

A retention is *lost* when a daemon acknowledged its registration and afterwards no
lookup was ever granted it, no later registration replaced it (the daemon hands the
replaced one back to be released), no daemon had D's sidecar release it (its budget,
or a put-back the conversation's next registration overtook: reason orphan), and it is
not among those the daemons hold unclaimed at the end.

Documented losses, by design, counted apart:
- `unacked`: registrations never acknowledged. They are not retentions the system
  took on: a sidecar retries them, and drops them when the conversation's next turn
  came first or its tries ran out (during lost quorum: the next turn recomputes).
- `in_doubt`: retentions whose claim was under way the moment the fault struck. A claim
  etcd applied but could not answer is read back (controlplane.store.retentions
  `_settle_claim`) for CLAIM_SETTLE_PAUSES_S; when etcd still cannot tell by then
  (quorum lost for 25 s), the retention is spent with nobody told. A claim a daemon
  had sent when it was stopped (SIGSTOP) is answered 15 s late, to a turn long gone:
  the daemon puts it back, unless the conversation registered a newer one meanwhile.
  Either way D frees the blocks at their TTL. Counted so: lost, and the conversation's
  next lookup went out between IN_DOUBT_BEFORE_S before the fault and IN_DOUBT_AFTER_S
  after it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.store.retentions import CLAIM_SETTLE_PAUSES_S
from tests.faults.ledger import Ledger
from tests.faults.load import Turn

IN_DOUBT_BEFORE_S = 2.0
"""A lookup sent this long before the fault may still be at etcd when it strikes (the
router's lookup deadline is 1 s; a loaded machine adds to it)."""
IN_DOUBT_AFTER_S = sum(CLAIM_SETTLE_PAUSES_S) + 1.0
"""...or be sent just after and reach etcd as it breaks; its claim is settled by then."""


@dataclass(frozen=True)
class Figures:
    """What one fault cost."""

    fault: str
    turns: int
    pulled: int
    client_errors: int
    wrong_answers: int
    double_claims: int
    unheld_reads: int
    registered: int
    unacked: int
    in_doubt: int
    lost: int
    reuse_back_s: float | None
    """From the fault's end (quorum restored, the member or daemon back) to the first turn
    started after it that pulled; None: no turn pulled."""
    no_reuse_turns: int
    """Later turns of a conversation served without reuse (the fault's cost in TTFT)."""
    no_pull_s: float
    """The longest stretch, from the fault on, with no turn pulling (ends of pulled turns)."""

    def row(self) -> str:
        back = "-" if self.reuse_back_s is None else f"{self.reuse_back_s:.2f}"
        return (
            f"{self.fault:<22} {self.turns:>5} {self.pulled:>6} {self.no_reuse_turns:>8} "
            f"{self.client_errors:>6} {self.wrong_answers:>5} {self.double_claims:>6} "
            f"{self.unheld_reads:>6} {self.registered:>5} {self.unacked:>7} {self.in_doubt:>8} "
            f"{self.lost:>4} {back:>10} {self.no_pull_s:>10.2f}"
        )


HEADER = (
    f"{'fault':<22} {'turns':>5} {'pulled':>6} {'no reuse':>8} {'errors':>6} {'wrong':>5} "
    f"{'double':>6} {'unheld':>6} {'regs':>5} {'unacked':>7} {'in doubt':>8} {'lost':>4} {'reuse back':>10} "
    f"{'no pull s':>10}"
)
LEGEND = (
    "turns: client turns through the router during the test; pulled: turns that pulled the\n"
    "previous turn's KV; no reuse: later turns (not a conversation's first) served without it;\n"
    "errors: turns not answered 200 in full; wrong: answers differing from the reference\n"
    "engine's; double: retentions handed out more than once; unheld: D's reads of blocks not\n"
    "held for the request named; regs: registrations the daemons acknowledged; unacked:\n"
    "registrations never acknowledged (dropped by the sidecar: documented losses); in doubt:\n"
    "retentions whose claim was at etcd as it broke (documented losses); lost: other\n"
    "acknowledged retentions neither granted, replaced, released nor still held; reuse back:\n"
    "seconds "
    "from the fault's end to the first turn started after it that pulled; no pull s: the\n"
    "longest stretch from the fault on in which no turn pulled."
)


def lost_retentions(ledger: Ledger, unclaimed: Iterable[str]) -> set[str]:
    """Retentions acknowledged, then neither granted, replaced, released nor held at the end."""
    acked = {r.retention for r in ledger.registrations if r.outcome == "ok"}
    granted = {g.retention for g in ledger.grants}
    replaced = {r.replaced for r in ledger.registrations if r.replaced}
    released = {r.retention for r in ledger.releases}
    return acked - granted - replaced - released - set(unclaimed)


def in_doubt(lost: set[str], ledger: Ledger, turns: Sequence[Turn], broken_at: float) -> set[str]:
    """The lost retentions whose conversation's next lookup went out around `broken_at`."""
    registered = {r.retention: r for r in ledger.registrations if r.outcome == "ok"}
    doubtful = set()
    for retention in lost:
        reg = registered[retention]
        later = [t.started for t in turns if t.conversation == reg.conversation_id and t.started > reg.at]
        if later and broken_at - IN_DOUBT_BEFORE_S <= min(later) <= broken_at + IN_DOUBT_AFTER_S:
            doubtful.add(retention)
    return doubtful


def unacked(ledger: Ledger) -> set[str]:
    """Retentions whose every registration try failed."""
    acked = {r.retention for r in ledger.registrations if r.outcome == "ok"}
    return {r.retention for r in ledger.registrations if r.outcome != "ok"} - acked


def no_pull_s(turns: Sequence[Turn], broken_at: float) -> float:
    ends = sorted(t.ended for t in turns if t.decision == "PULL" and t.ended >= broken_at)
    marks = [broken_at, *ends]
    return max((b - a for a, b in itertools.pairwise(marks)), default=0.0)


def reuse_back_s(turns: Sequence[Turn], restored_at: float) -> float | None:
    pulled = [t.ended for t in turns if t.started >= restored_at and t.decision == "PULL"]
    return min(pulled) - restored_at if pulled else None


def figures(
    fault: str,
    turns: Sequence[Turn],
    ledger: Ledger,
    unclaimed: Iterable[str],
    unheld_reads: int,
    window: tuple[float, float],
) -> Figures:
    """`window`: when the fault struck and when it was mended (time.monotonic())."""
    broken_at, restored_at = window
    acked = {r.retention for r in ledger.registrations if r.outcome == "ok"}
    lost = lost_retentions(ledger, unclaimed)
    doubtful = in_doubt(lost, ledger, turns, broken_at)
    return Figures(
        fault=fault,
        turns=len(turns),
        pulled=sum(t.decision == "PULL" for t in turns),
        client_errors=sum(t.status != 200 for t in turns),
        wrong_answers=sum(t.status == 200 and not t.correct for t in turns),
        double_claims=len(ledger.double_claims()),
        unheld_reads=unheld_reads,
        registered=len(acked),
        unacked=len(unacked(ledger)),
        in_doubt=len(doubtful),
        lost=len(lost - doubtful),
        reuse_back_s=reuse_back_s(turns, restored_at),
        no_reuse_turns=sum(t.turn > 0 and t.decision != "PULL" for t in turns),
        no_pull_s=no_pull_s(turns, broken_at),
    )


def table(rows: Sequence[Figures]) -> str:
    return "\n".join([HEADER, *(r.row() for r in rows), "", LEGEND])

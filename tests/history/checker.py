"""The single-use checker: given a history of operations on retentions, as clients saw
them, find every retention handed out twice, handed out after its release, or handed
out that was never registered (or for another conversation).

Pure: no I/O, no kvferry import. A history is a list of `Op`, each what one client (a
`process`) invoked at `invoked` and saw complete at `completed`, on one clock
(time.monotonic() of the one test process that recorded them all), with its outcome:

- OK: the daemon answered; `handed` names the retention the answer gave the caller
  (the params of a PULL, or release params: either way D's blocks are the caller's to
  pull or free, and nobody else's), `retired` the one it took out of the store (a
  lookup's claim, a revoke that found it, a registration replacing it with release
  params, a budget release);
- FAILED: a definite refusal: it took no effect;
- UNKNOWN: timed out, cancelled, connection lost: it may or may not have taken effect,
  and whatever it would have handed out is unknown.

A retention is named by a unique id the workload puts in its params (D's
``remote_request_id``); each is registered once (a registration whose outcome is
unknown is never sent again, as the sidecar does: see sidecar.retentions).

The rules (`check`):

- twice: a retention handed out by two operations that both completed OK (two
  lookups, or a lookup and a release of any kind, or two releases), or taken out of the
  store by two (a revoke finding what a lookup handed out, say);
- after_release: a lookup handing out X that was invoked after an operation that
  released or revoked X had completed;
- superseded: a lookup handing out X that was invoked after a registration of another
  retention for the same conversation completed, X's registration having completed
  before that one was invoked (Register replaces the conversation's retention);
- expired: X handed out by an operation invoked after X's deadline (D frees the blocks
  then: its own release), by more than `CLOCK_SLACK_S`;
- unregistered: X handed out with no registration of X that may have taken effect
  (OK or UNKNOWN), or with one only invoked after the handing out completed;
- foreign: X handed out for another tenant or conversation than it was registered for;
- stale_node: X handed out by a lookup invoked more than NODE_WINDOW_S after its engine
  was registered as a new process (a NODE op, OK), X's registration having completed
  before that was invoked: X's blocks were the old process's (a replica decides a pull
  on a view of the node at most that old: controlplane.service.nodecache, solewriter).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

CLOCK_SLACK_S = 0.05
"""How far the daemon's wall clock and the history's (converted) may disagree."""


class Kind(enum.StrEnum):
    """What a client did."""

    REGISTER = "register"
    """A sidecar registered retention `retention` (Leases/Register or a Stream op)."""
    LOOKUP = "lookup"
    """A client looked the conversation up (Leases/Lookup or a Stream op); claims."""
    REVOKE = "revoke"
    """Leases/Revoke (a conversation's end or not)."""
    RELEASE = "release"
    """A ReleaseRetention a sidecar got on its Attach stream: invoked when it arrived (the
    daemon decided it earlier, when is not known), completed then too."""
    NODE = "node"
    """A sidecar registered its engine `engine` as a new process (an engine restart: a new
    generation); its retentions registered before are dead."""


class Status(enum.StrEnum):
    """How an operation ended, as its client saw it."""

    OK = "ok"
    FAILED = "failed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Op:
    """One recorded operation."""

    process: str
    kind: Kind
    tenant: str
    conversation: str
    invoked: float
    completed: float
    """When the client saw its outcome (for UNKNOWN: when it gave up)."""
    status: Status
    retention: str = ""
    """REGISTER: the retention registered."""
    handed: str = ""
    """OK only: the retention the answer handed to the caller ("" none)."""
    retired: str = ""
    """OK only: the retention it took out of the store ("" none). A lookup handing X out
    took X; a revoke that found X took it whether or not its answer hands X's release
    out (a conversation's end has the daemon tell D's sidecar over Attach instead: that
    RELEASE hands X out without taking it again); a budget RELEASE took it."""
    detail: str = ""
    """The lookup's reason, the error's code: for the report only."""
    expires: float = math.inf
    """REGISTER only: the retention's deadline, on the history's clock."""
    late: bool = False
    """LOOKUP only: the answer came after its caller gave up (nobody pulls what it hands
    out: the router has D free it, `LeaseStream.lookup_with_prompt`'s `late`)."""
    engine: str = ""
    """REGISTER: the engine the retention was registered on; NODE: the engine registered."""

    def line(self) -> str:
        """The op, on one line, for a violation's excerpt."""
        what = {
            "retention": self.retention,
            "handed": self.handed,
            "retired": self.retired,
            "detail": self.detail,
        }
        extra = " ".join(f"{k}={v}" for k, v in what.items() if v)
        return (
            f"[{self.invoked:.3f}..{self.completed:.3f}] {self.process} {self.kind} "
            f"{self.tenant}/{self.conversation} {self.status} {extra}"
        ).rstrip()


class Rule(enum.StrEnum):
    TWICE = "twice"
    AFTER_RELEASE = "after_release"
    SUPERSEDED = "superseded"
    EXPIRED = "expired"
    UNREGISTERED = "unregistered"
    FOREIGN = "foreign"
    STALE_NODE = "stale_node"


@dataclass(frozen=True)
class Violation:
    rule: Rule
    retention: str
    ops: tuple[Op, ...]
    """The operations that show it, in invocation order."""
    text: str

    def excerpt(self) -> str:
        """The violation and the history that shows it."""
        return "\n".join(
            [f"{self.rule}: {self.retention}: {self.text}", *("  " + o.line() for o in self.ops)]
        )


@dataclass
class Report:
    """What `check` found, and what the history held."""

    violations: list[Violation] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    """Ops by "kind status" and lookups by "lookup reason"; "handed lookup" etc."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        """The counts, one per line, and each violation with its excerpt."""
        lines = [f"{k}: {n}" for k, n in sorted(self.counts.items())]
        lines += [v.excerpt() for v in self.violations]
        return "\n".join(lines)


def check(history: Iterable[Op]) -> Report:
    """Every violation of single use in `history` (see the module's rules), and its counts."""
    ops = sorted(history, key=lambda o: (o.invoked, o.completed))
    report = Report(counts=_counts(ops))
    index = _Index(ops)
    for x in index.handed.keys() | index.retired.keys():
        report.violations += _twice(x, index.handed.get(x, []), index.retired.get(x, []))
    for x, outs in index.handed.items():
        regs = index.registered.get(x, [])
        report.violations += _registration(x, outs, regs)
        report.violations += _after_release(x, outs, index.gone.get(x, []))
        report.violations += _superseded(x, outs, regs, index)
        report.violations += _expired(x, outs, regs)
        report.violations += _stale_node(x, outs, regs, index)
    return report


class _Index:
    """The history's ops by retention and by conversation, in invocation order."""

    def __init__(self, ops: Sequence[Op]) -> None:
        self.registered: dict[str, list[Op]] = {}
        self.handed: dict[str, list[Op]] = {}
        self.retired: dict[str, list[Op]] = {}
        self.gone: dict[str, list[Op]] = {}
        """OK ops that released or revoked the retention."""
        self.stored: dict[tuple[str, str], list[Op]] = {}
        """OK registrations, by (tenant, conversation)."""
        self.restarts: dict[str, list[Op]] = {}
        """OK registrations of an engine as a new process, by engine."""
        for o in ops:
            if o.kind is Kind.NODE and o.status is Status.OK:
                self.restarts.setdefault(o.engine, []).append(o)
            if o.kind is Kind.REGISTER and o.retention:
                self.registered.setdefault(o.retention, []).append(o)
                if o.status is Status.OK:
                    self.stored.setdefault((o.tenant, o.conversation), []).append(o)
            if o.status is not Status.OK:
                continue
            if o.handed:
                self.handed.setdefault(o.handed, []).append(o)
            if o.retired:
                self.retired.setdefault(o.retired, []).append(o)
            if o.kind is not Kind.LOOKUP:
                for x in {o.handed, o.retired} - {""}:
                    self.gone.setdefault(x, []).append(o)


def _counts(ops: Sequence[Op]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for o in ops:
        counts[f"{o.kind} {o.status}"] += 1
        if o.status is not Status.OK:
            counts[f"{o.kind} {o.status} {o.detail or '?'}"] += 1
        if o.kind is Kind.LOOKUP and o.status is Status.OK:
            counts[f"lookup reason {o.detail or '?'}"] += 1
        if o.status is Status.OK and o.handed:
            counts[f"handed out by {o.kind}"] += 1
    return counts


FAILOVER_GRACE_S = 5.0
"""An unclean owner takeover releases every retention of the shard, after this grace
(controlplane.settings.OwnerSettings.grace_s), without knowing which ones the lost owner
handed out from memory. A release of X at least this long after a lookup handed X out
takes nothing from anyone: the pull is over, D freed X's blocks then, and a release of
freed blocks is a no-op on D. Nor does one after a lookup answered late (its caller had
given up, and pulls nothing: a paused owner's answer, sent when it resumed). One sooner
after an answer in time could race the pull: that stays a violation."""


def _settled_failover(o: Op, handed: list[Op]) -> bool:
    """Whether `o` is a failover release of a retention a lookup handed out (and completed)
    FAILOVER_GRACE_S or more before it, or handed out late (see FAILOVER_GRACE_S)."""
    return (
        o.kind is Kind.RELEASE
        and o.detail == "failover"
        and any(
            h.kind is Kind.LOOKUP and (h.late or h.completed + FAILOVER_GRACE_S <= o.invoked) for h in handed
        )
    )


def _twice(x: str, handed: list[Op], retired: list[Op]) -> list[Violation]:
    settled = [o for o in handed if _settled_failover(o, handed)]
    handed = [o for o in handed if o not in settled]
    retired = [o for o in retired if o not in settled]
    if len(handed) < 2 and len(retired) < 2:
        return []
    shown = sorted({id(o): o for o in handed + retired}.values(), key=lambda o: o.invoked)
    kinds = " and ".join(str(o.kind) for o in shown)
    text = f"handed out {len(handed)} times, taken {len(retired)} times ({kinds})"
    return [Violation(Rule.TWICE, x, tuple(shown), text)]


def _registration(x: str, outs: list[Op], regs: list[Op]) -> list[Violation]:
    """unregistered and foreign."""
    found: list[Violation] = []
    live = [r for r in regs if r.status is not Status.FAILED]
    for o in outs:
        before = [r for r in live if r.invoked < o.completed]
        if not before:
            why = "never registered" if not live else "registered only after it was handed out"
            found.append(Violation(Rule.UNREGISTERED, x, (*regs, o), why))
            continue
        r = before[0]
        if (o.tenant, o.conversation) != (r.tenant, r.conversation):
            text = f"registered for {r.tenant}/{r.conversation}, handed out for {o.tenant}/{o.conversation}"
            found.append(Violation(Rule.FOREIGN, x, (r, o), text))
    return found


def _after_release(x: str, outs: list[Op], gone: list[Op]) -> list[Violation]:
    """A lookup invoked after a release or revoke of X had completed."""
    found = []
    for o in outs:
        if o.kind is not Kind.LOOKUP:
            continue
        earlier = [g for g in gone if g is not o and g.completed < o.invoked]
        if earlier:
            text = f"lookup invoked {o.invoked - earlier[0].completed:.3f}s after the {earlier[0].kind}"
            found.append(Violation(Rule.AFTER_RELEASE, x, (earlier[0], o), text))
    return found


def _expired(x: str, outs: list[Op], regs: list[Op]) -> list[Violation]:
    """Handed out by an op invoked after the deadline (a RELEASE's invocation is when it
    arrived: the daemon may have decided it before the deadline, so it is not judged)."""
    deadline = min((r.expires for r in regs), default=math.inf)
    found = []
    for o in outs:
        if o.kind is not Kind.RELEASE and o.invoked > deadline + CLOCK_SLACK_S:
            text = f"{o.kind} invoked {o.invoked - deadline:.3f}s after its deadline"
            found.append(Violation(Rule.EXPIRED, x, (regs[0], o), text))
    return found


def _superseded(x: str, outs: list[Op], regs: list[Op], index: _Index) -> list[Violation]:
    """A lookup invoked after a newer registration of the conversation completed."""
    if not regs or any(r.status is Status.UNKNOWN for r in regs):
        return []  # (a registration of unknown outcome may land at any time after)
    done = max(r.completed for r in regs)
    first = regs[0]
    stored = index.stored.get((first.tenant, first.conversation), [])
    newer = [o for o in stored if o.retention != x and o.invoked > done]
    found = []
    for o in outs:
        if o.kind is not Kind.LOOKUP:
            continue
        before = [n for n in newer if n.completed < o.invoked]
        if before:
            text = f"lookup invoked after {before[0].retention} replaced it"
            found.append(Violation(Rule.SUPERSEDED, x, (first, before[0], o), text))
    return found


NODE_WINDOW_S = 0.05
"""How old a replica's view of a node may be when it decides a pull on it: a confirming
read begun at most CONFIRM_S (controlplane.service.nodecache) before the decision, on
the one etcd member of this run; none at all on a replica that wrote every node change."""


def _stale_node(x: str, outs: list[Op], regs: list[Op], index: _Index) -> list[Violation]:
    """A lookup invoked after X's engine was registered anew (see the module's rules)."""
    if not regs or any(r.status is not Status.OK for r in regs):
        return []  # (one of unknown outcome may have landed on the new process)
    done = max(r.completed for r in regs)
    restarts = [n for n in index.restarts.get(regs[0].engine, []) if n.invoked > done]
    found = []
    for o in outs:
        if o.kind is not Kind.LOOKUP or o.late:
            continue
        before = [n for n in restarts if n.completed + NODE_WINDOW_S < o.invoked]
        if before:
            text = f"lookup invoked {o.invoked - before[0].completed:.3f}s after {regs[0].engine} restarted"
            found.append(Violation(Rule.STALE_NODE, x, (regs[0], before[0], o), text))
    return found

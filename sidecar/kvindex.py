"""The engine's prefix cache as the sidecar mirrors it, folded into net-effect batches.

vLLM reports every block it caches (``BlockStored``) and evicts
(``BlockRemoved``); the same hash may be cached in several blocks at once (two
requests computed the same prefix), so the mirror counts copies and the daemon
hears only of a hash's presence changing: 0 -> 1 copies is *stored*, 1 -> 0 is
*removed*. Between two sends the changes fold into one `KvBatch` whose meaning
is the daemon's: drop everything if ``cleared``, then remove ``removed``, then
add ``stored`` (the two are disjoint). When the daemon's view is unknown (a new
Attach stream, a gap that could not be replayed, an engine restart) the next
batches are a *reset*: the whole mirror, first chunk flagged ``reset``.

An engine with data parallelism has a cache, and a KV-event stream, per rank; the
node's mirror is their union. Each rank's copies are counted apart, so a rank's
``AllBlocksCleared`` (or a removal of a block only another rank holds) takes away
that rank's copies alone.

Also here: `SeqTracker`, the decision of what an incoming seq number means
(in order, replay overlap, gap, engine restart). Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from sidecar.kvevents import Cleared, KvEvent, Removed, Stored


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One Attach ``kv_events`` message (see kvferry.v1.KvEventBatch)."""

    seq: int
    stored: list[int]
    removed: list[int]
    cleared: bool = False
    reset: bool = False

    @property
    def size(self) -> int:
        """Hashes carried."""
        return len(self.stored) + len(self.removed)


class _Copies:
    """One data-parallel rank's copies of each hash: a set, and the few cached twice."""

    __slots__ = ("extra", "present")

    def __init__(self) -> None:
        self.present: set[int] = set()
        self.extra: dict[int, int] = {}

    def store(self, hashes: list[int]) -> None:
        fresh = set(hashes)
        if len(fresh) == len(hashes) and self.present.isdisjoint(fresh):
            self.present |= fresh  # the common case: new blocks, one copy each
            return
        for h in hashes:
            if h in self.present:
                self.extra[h] = self.extra.get(h, 0) + 1
            else:
                self.present.add(h)

    def remove(self, hashes: list[int]) -> list[int]:
        """Take one copy of each of `hashes` away; -> those it had (a block never seen
        stored on this rank is not its to remove)."""
        gone = []
        for h in hashes:
            copies = self.extra.get(h)
            if copies:
                gone.append(h)
                if copies == 1:
                    del self.extra[h]
                else:
                    self.extra[h] = copies - 1
            elif h in self.present:
                self.present.discard(h)
                gone.append(h)
        return gone

    def clear(self) -> list[int]:
        """Take every copy away; -> them."""
        gone = [*self.present, *(h for h, copies in self.extra.items() for _ in range(copies))]
        self.present, self.extra = set(), {}
        return gone


class KvMirror:
    """Copies per hash of the engine's cache, and what changed since the last drain.

    For every hash whose presence changed since the last drain, `_baseline`
    remembers whether the daemon has it (present at the last drain, and no
    clear since); a drain compares that with the present state. Tracking
    only "stored" and "removed" sets loses a remove-store-remove within one
    window.
    """

    def __init__(self, ranks: int = 1) -> None:
        self._ranks: list[_Copies] | None = [_Copies() for _ in range(ranks)] if ranks > 1 else None
        """Each data-parallel rank's copies (None: one rank, the union itself)."""
        self._present: set[int] = set()
        # Copies beyond the first, for the few hashes cached in several blocks.
        self._extra: dict[int, int] = {}
        self._baseline: dict[int, bool] = {}
        self._cleared = False
        self._reset = True  # the daemon's view of this node is unknown at first
        self.seq = -1
        """Engine seq of the last payload folded in (-1: none yet)."""

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._present

    def hashes(self) -> set[int]:
        """The hashes the engine caches, as far as the sidecar knows."""
        return set(self._present)

    @property
    def pending(self) -> int:
        """Hashes waiting to be sent, at most (a reset counts the whole mirror)."""
        if self._reset:
            return max(len(self._present), 1)
        return len(self._baseline) + (1 if self._cleared else 0)

    def apply(self, events: Iterable[KvEvent], seq: int | None = None, rank: int = 0) -> None:
        """Fold one payload of data-parallel rank `rank` in, its events in order. (`seq`, the
        one the daemon is told, is rank 0's.)"""
        if self._ranks is not None:
            self._apply_rank(events, self._ranks[rank])
        else:
            for event in events:
                if isinstance(event, Stored):
                    self._store(event.hashes)
                elif isinstance(event, Removed):
                    self._remove(event.hashes)
                elif isinstance(event, Cleared):
                    self._clear()
        if seq is not None and rank == 0:
            self.seq = seq

    def _apply_rank(self, events: Iterable[KvEvent], mine: _Copies) -> None:
        """One rank's events, as copies of the union: only what the rank holds leaves it."""
        for event in events:
            if isinstance(event, Stored):
                mine.store(event.hashes)
                self._store(event.hashes)
            elif isinstance(event, Removed):
                self._remove(mine.remove(event.hashes))
            elif isinstance(event, Cleared):
                self._remove(mine.clear())

    def _store(self, hashes: list[int]) -> None:
        present, baseline = self._present, self._baseline
        fresh = set(hashes)
        if len(fresh) == len(hashes) and present.isdisjoint(fresh):
            # The common case: new blocks, one copy each; the daemon has none of them
            # unless they were removed earlier in this window (then baseline says so).
            present |= fresh
            if self._reset:  # the next drain sends the whole mirror: no delta to keep
                return
            if baseline:
                common = baseline.keys() & fresh  # a dict view iterates the smaller side
                if common:
                    fresh -= common
            baseline.update(dict.fromkeys(fresh, False))
            return
        for h in hashes:
            if h in present:
                self._extra[h] = self._extra.get(h, 0) + 1
            else:
                present.add(h)
                if not self._reset:
                    baseline.setdefault(h, False)

    def _remove(self, hashes: list[int]) -> None:
        present, extra, baseline = self._present, self._extra, self._baseline
        for h in hashes:
            copies = extra.get(h)
            if copies:
                if copies == 1:
                    del extra[h]
                else:
                    extra[h] = copies - 1
            elif h in present:
                present.discard(h)
                if not self._reset:
                    baseline.setdefault(h, not self._cleared)
            # else: removal of a block never seen stored (joined late): nothing to undo

    def _clear(self) -> None:
        self._present.clear()
        self._extra.clear()
        self._baseline.clear()
        self._cleared = True

    def forget(self) -> None:
        """The engine restarted: its cache is gone, and the daemon must drop its index."""
        self._clear()
        for mine in self._ranks or ():
            mine.clear()
        self._cleared = False
        self._reset = True
        self.seq = -1

    def request_reset(self) -> None:
        """The daemon's view is unknown: the next drain sends the whole mirror.

        Until then no delta is kept (a long daemon outage would grow it without bound)."""
        self._reset = True
        self._baseline = {}
        self._cleared = False

    def drain(self, max_hashes: int = 65536) -> list[KvBatch]:
        """Batches that bring the daemon's view up to date (empty when it is)."""
        if self._reset:
            batches = self._snapshot(max_hashes)
        elif self._baseline or self._cleared:
            batches = self._delta(max_hashes)
        else:
            return []
        self._baseline = {}
        self._cleared = False
        self._reset = False
        return batches

    def _snapshot(self, max_hashes: int) -> list[KvBatch]:
        everything = list(self._present)
        chunks = [everything[i : i + max_hashes] for i in range(0, len(everything), max_hashes)] or [[]]
        return [KvBatch(self.seq, chunk, [], reset=(i == 0)) for i, chunk in enumerate(chunks)]

    def _delta(self, max_hashes: int) -> list[KvBatch]:
        present = self._present
        stored = [h for h, had in self._baseline.items() if not had and h in present]
        removed = [h for h, had in self._baseline.items() if had and h not in present]
        if not stored and not removed and not self._cleared:
            return []
        batches: list[KvBatch] = []
        first = True
        while first or removed or stored:
            take_removed, removed = removed[:max_hashes], removed[max_hashes:]
            room = max_hashes - len(take_removed)
            take_stored, stored = stored[:room], stored[room:]
            batches.append(KvBatch(self.seq, take_stored, take_removed, cleared=first and self._cleared))
            first = False
        return batches


class Verdict(enum.Enum):
    """What a received seq number means."""

    APPLY = "apply"
    """The next one: fold it in."""
    DUPLICATE = "duplicate"
    """Already folded in (from a replay, or delivered twice): skip it."""
    GAP = "gap"
    """Some before it are missing: replay from `SeqTracker.expected` first."""
    RESTART = "restart"
    """It went back to the start, or far back: a new engine publishes from 0."""


#: How far below the next expected seq a batch is still taken for one seen again (a
#: replay overlapping the live stream, a duplicate delivery) rather than a new engine.
#: vLLM's publisher numbers batches from 0 in each engine process and never reuses a seq.
DUPLICATE_SPAN = 1024


@dataclass
class SeqTracker:
    """Which seq comes next, and the overlap window a replay leaves behind.

    After a replay, messages already queued on the SUB socket repeat what the
    replay returned; they are duplicates, not a restart, until a message at or
    past `expected` arrives (SUB delivers in order) or `overlap_s` has passed.
    Past that window a seq a little below `expected` (within `DUPLICATE_SPAN`) is
    still a batch seen again: only a seq back at 0 (the batch just folded in aside)
    or further back than the span is a new engine. A new engine that published only
    a few batches before one of them came round again is told apart by its process
    identity instead (a probe after the publisher's reconnection, identity.py).
    """

    expected: int = 0
    overlap_s: float = 2.0
    _overlap_until: float | None = None

    def classify(self, seq: int, now: float) -> Verdict:
        if seq == self.expected:
            self._overlap_until = None
            return Verdict.APPLY
        if seq > self.expected:
            return Verdict.GAP
        if self._overlap_until is not None and now < self._overlap_until:
            return Verdict.DUPLICATE
        if seq == self.expected - 1 or (seq > 0 and self.expected - seq <= DUPLICATE_SPAN):
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def applied(self, seq: int) -> None:
        """`seq` was folded in."""
        self.expected = seq + 1

    def replayed(self, last_seq: int | None, now: float) -> None:
        """A replay folded in everything up to `last_seq` (None: it returned nothing)."""
        if last_seq is not None and last_seq >= self.expected:
            self.expected = last_seq + 1
        self._overlap_until = now + self.overlap_s

    def skip_to(self, seq: int) -> None:
        """Give up on what is missing before `seq` (it cannot be replayed)."""
        self.expected = seq

    def restart(self) -> None:
        """A new engine: its seq starts at 0."""
        self.expected = 0
        self._overlap_until = None


def replay_outcome(expected: int, replayed_seqs: list[int]) -> bool:
    """Whether a replay from `expected` returned a complete run (nothing missing).

    An empty answer is complete (nothing was published since); otherwise the
    first seq must be `expected` and the rest consecutive.
    """
    if not replayed_seqs:
        return True
    if replayed_seqs[0] > expected:
        return False
    prev = replayed_seqs[0]
    for s in replayed_seqs[1:]:
        if s != prev + 1:
            return False
        prev = s
    return True

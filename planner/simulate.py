"""The event simulation: a workload replayed through P, D's pool and a retention policy. Pure.

What it models (each step as kvferry and the emulator do it):

- A turn arrives: at its timestamp, or ``think_s`` after its conversation's previous
  turn ended, `clients` conversations at a time. A kvferry trace's later turns keep
  their recorded think time after the previous turn's end, and that end keeps its
  recorded lag: how much later (or earlier) than the model's end for it, on the
  recorded arrivals with the recorded reuse, the turn really ended (`recorded_lags`). So
  a configuration moves a turn by what the model says it changes, and replaying the
  recorded configuration keeps the recorded timeline, stalls of the machine and all,
  which P's queue (modelled on it, as the fit models it) depends on.
- Its lookup claims the conversation's retention, if one is live and more than the
  daemon's safety margin (10 s) from its expiry: P pulls ``min(shared, retained)``
  tokens, cut to whole blocks, when that is at least the recompute threshold (the
  daemon's `controlplane.policy.decide`); else P recomputes and the retention is
  released. Either way the retention ends there. A turn whose lookup the recorded run
  skipped (`planner.traces.Measured.skipped_for_the_run`: the daemon late, say) skips it
  here too; its retention stays until the turn's own replaces it.
- P computes the rest, one prefill at a time; D pulls the prompt from P; the answer takes
  decode x output tokens (`planner.costs.CostModel`). D holds the turn's blocks (prompt
  and output) while it runs.
- At the turn's end D retains its blocks for the TTL. With a budget (a share of D's pool)
  retentions over it are released early: ``fixed``, the oldest first; ``value``, the least
  valuable first (`kvferry.retentionvalue`: the daemon's rule). With ``value``, a turn
  that finds D's pool full gets room from retentions first (least valuable first); with
  ``fixed`` (vLLM's own behaviour) it counts as a pool-full moment: D would make it wait,
  then 503. ``idle`` is ``value`` plus the daemon's idle release (its defaults:
  `planner.value.idle_after`): a retention idle far past every return interval seen goes
  early.

What comes out per configuration: `Outcome` (hit rate, reused tokens, block-seconds held
per reused token, TTFT, D's pool use over time).
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from dataclasses import dataclass, field

from kvferry.retentionvalue import blocks_for, value_per_block_second
from planner.costs import CostModel, recorded_ttfts
from planner.traces import Turn, Workload
from planner.value import ReturnIntervals, idle_after

POLICIES = ("fixed", "value", "idle")
SAFETY_MARGIN_S = 10.0
"""No pull this close to a retention's expiry (the daemon's ``--safety-margin`` default)."""


@dataclass(frozen=True)
class Config:
    """One configuration of the retention policy to try."""

    ttl_s: float = 480.0
    threshold: int = 64
    budget: float = 1.0
    """Share of D's pool retentions may hold (1.0: the whole pool)."""
    policy: str = "fixed"
    pool_blocks: int = 4096
    reuse: bool = True
    """False: no lookups, nothing retained (the baseline TTFT saved is measured against)."""

    def validate(self) -> None:
        """ValueError on a value out of range."""
        if self.ttl_s < 0 or self.threshold < 0 or self.pool_blocks < 1:
            raise ValueError("ttl and threshold must be >= 0, the pool at least one block")
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget must be a share of the pool in (0, 1], not {self.budget}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")

    @property
    def label(self) -> str:
        """How the report names it."""
        return f"ttl {self.ttl_s:g}s thr {self.threshold} budget {self.budget:g} {self.policy}"


@dataclass(frozen=True)
class TurnResult:
    """What the simulation predicts for one turn."""

    turn: Turn
    decision: str
    reused_tokens: int
    ttft_ms: float


@dataclass
class Outcome:
    """What one configuration buys on the workload."""

    config: Config
    turns: list[TurnResult] = field(default_factory=list)
    block_seconds: float = 0.0
    """Retained blocks x seconds held (until claimed, released or expired)."""
    pool_full: int = 0
    """Turns that found D's pool full (``fixed``: D would make them wait, then refuse)."""
    releases: dict[str, int] = field(
        default_factory=lambda: {
            "claimed": 0,
            "expiry": 0,
            "budget": 0,
            "near_full": 0,
            "idle": 0,
            "replaced": 0,
        }
    )
    pressure: list[tuple[float, float, float]] = field(default_factory=list)
    """(seconds, share of D's pool in use, share held by retentions), at each event."""

    @property
    def hits(self) -> int:
        return sum(r.decision == "PULL" for r in self.turns)

    @property
    def hit_rate(self) -> float:
        """Share of all turns that pulled (first turns included, as `make demo` counts)."""
        return self.hits / len(self.turns) if self.turns else 0.0

    @property
    def reused_tokens(self) -> int:
        return sum(r.reused_tokens for r in self.turns)

    @property
    def block_seconds_per_reused_token(self) -> float:
        return self.block_seconds / self.reused_tokens if self.reused_tokens else math.inf

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(r.ttft_ms for r in self.turns) if self.turns else math.nan

    @property
    def ttft_mean_ms(self) -> float:
        return statistics.fmean(r.ttft_ms for r in self.turns) if self.turns else math.nan

    @property
    def peak_pressure(self) -> float:
        return max((p for _, p, _ in self.pressure), default=0.0)


@dataclass
class _Retention:
    conversation: str
    tokens: int
    blocks: int
    start: float
    expiry: float
    serial: int


class _Engines:
    """The state the events change: retentions, D's pool, P's GPU."""

    def __init__(self, config: Config, costs: CostModel, out: Outcome) -> None:
        self.c, self.costs, self.out = config, costs, out
        self.retained: dict[str, _Retention] = {}
        self.expiries: list[tuple[float, int, str]] = []
        self.retained_blocks = 0
        self.active_blocks = 0
        self.gpu_free_ms = -math.inf
        self.intervals = ReturnIntervals()
        self.serials = itertools.count()

    # -- retentions -------------------------------------------------------------------

    def expire_until(self, now: float) -> None:
        if self.c.policy == "idle":
            self.release_idle(now)
        while self.expiries and self.expiries[0][0] <= now:
            expiry, serial, conv = heapq.heappop(self.expiries)
            r = self.retained.get(conv)
            if r is not None and r.serial == serial:
                self.intervals.expired()
                self.release(r, expiry, "expiry")

    def release_idle(self, now: float) -> None:
        """The daemon's idle release: retentions idle past `idle_after` go, at that moment."""
        after = idle_after(self.intervals)
        if after is None:
            return
        for r in [r for r in self.retained.values() if r.start + after < min(now, r.expiry)]:
            self.release(r, r.start + after, "idle")

    def release(self, r: _Retention, now: float, reason: str) -> None:
        del self.retained[r.conversation]
        self.retained_blocks -= r.blocks
        self.out.block_seconds += r.blocks * max(0.0, min(now, r.expiry) - r.start)
        self.out.releases[reason] += 1

    def retain(self, turn: Turn, now: float) -> None:
        tokens = turn.prompt_tokens + turn.output_tokens
        blocks = blocks_for(tokens, self.costs.block_size)
        cap = self.c.budget * self.c.pool_blocks
        if not self.c.reuse or self.c.ttl_s <= SAFETY_MARGIN_S or blocks > cap:
            return
        replaced = self.retained.get(turn.conversation)
        if replaced is not None:  # (a turn that skipped its lookup left it: the daemon replaces it)
            self.release(replaced, now, "replaced")
        while self.retained_blocks + blocks > cap and self.retained:
            self.intervals.expired()
            self.release(self.victim(now), now, "budget")
        r = _Retention(turn.conversation, tokens, blocks, now, now + self.c.ttl_s, next(self.serials))
        self.retained[r.conversation] = r
        self.retained_blocks += blocks
        heapq.heappush(self.expiries, (r.expiry, r.serial, r.conversation))

    def victim(self, now: float) -> _Retention:
        """The retention a budget releases first."""
        if self.c.policy == "fixed":
            return min(self.retained.values(), key=lambda r: (r.start, r.serial))

        def value(r: _Retention) -> tuple[float, int]:
            remaining = r.expiry - now
            p = self.intervals.p_return(now - r.start, remaining)
            return value_per_block_second(r.tokens, r.blocks, p, remaining), r.serial

        return min(self.retained.values(), key=value)

    # -- a turn -----------------------------------------------------------------------

    def arrive(self, turn: Turn, now: float) -> TurnResult:
        """The turn's lookup, prefill and D's allocation; -> its predicted result."""
        self.expire_until(now)
        decision, reused = ("RECOMPUTE", 0) if self.c.reuse else ("NONE", 0)
        skipped = self.c.reuse and turn.measured is not None and turn.measured.skipped_for_the_run
        r = None if skipped else self.retained.get(turn.conversation)
        if skipped:
            decision = "SKIPPED"
        if r is not None:
            self.intervals.returned(now - r.start)
            if now < r.expiry - SAFETY_MARGIN_S:
                bs = self.costs.block_size
                reusable = min(turn.shared_tokens, r.tokens) // bs * bs
                if reusable >= max(self.c.threshold, 1):
                    decision, reused = "PULL", reusable
            self.release(r, now, "claimed")
        ttft = self.ttft_ms(turn, reused, now)
        need = blocks_for(turn.prompt_tokens + turn.output_tokens, self.costs.block_size)
        if self.active_blocks + self.retained_blocks + need > self.c.pool_blocks:
            if self.c.policy != "fixed":
                while self.retained and self.active_blocks + self.retained_blocks + need > self.c.pool_blocks:
                    self.intervals.expired()
                    self.release(self.victim(now), now, "near_full")
            if self.active_blocks + self.retained_blocks + need > self.c.pool_blocks:
                self.out.pool_full += 1
        self.active_blocks += need
        return TurnResult(turn, decision, reused, ttft)

    def ttft_ms(self, turn: Turn, reused: int, now: float) -> float:
        m = self.costs
        t_ms = now * 1e3
        ready = t_ms + m.overhead_ms + m.transfer_ms_per_block * blocks_for(reused, m.block_size)
        start = max(ready, self.gpu_free_ms)
        self.gpu_free_ms = start + m.prefill_ms_per_token * max(1, turn.prompt_tokens - reused)
        return (
            self.gpu_free_ms + m.transfer_ms_per_block * blocks_for(turn.prompt_tokens, m.block_size) - t_ms
        )

    def finish(self, turn: Turn, now: float) -> None:
        self.expire_until(now)
        self.active_blocks -= blocks_for(turn.prompt_tokens + turn.output_tokens, self.costs.block_size)
        self.retain(turn, now)

    def sample(self, now: float) -> None:
        pool = self.c.pool_blocks
        self.out.pressure.append(
            (now, (self.active_blocks + self.retained_blocks) / pool, self.retained_blocks / pool)
        )


def simulate(
    workload: Workload, config: Config, costs: CostModel, think_s: float = 0.0, clients: int = 1
) -> Outcome:
    """Replay `workload` under `config`; deterministic."""
    config.validate()
    costs.validate()
    out = Outcome(config)
    eng = _Engines(config, costs, out)
    events: list[tuple[float, int, str, Turn]] = []
    seq = itertools.count()
    convs = _all_conversations(workload)
    follow = {id(t): (conv, i) for conv in convs for i, t in enumerate(conv)}
    pending = iter(convs)
    lags = recorded_lags(workload, costs)
    if workload.timed:  # first turns at their times; later ones when the previous has ended
        for conv in convs:
            heapq.heappush(events, (conv[0].arrival_s or 0.0, next(seq), "arrive", conv[0]))
    else:
        for conv in itertools.islice(pending, max(1, clients)):
            heapq.heappush(events, (0.0, next(seq), "arrive", conv[0]))
    while events:
        now, _, kind, turn = heapq.heappop(events)
        if kind == "arrive":
            result = eng.arrive(turn, now)
            out.turns.append(result)
            end = now + (result.ttft_ms + costs.decode_ms_per_token * turn.output_tokens) / 1e3
            heapq.heappush(events, (end, next(seq), "finish", turn))
        else:
            eng.finish(turn, now)
            conv, i = follow[id(turn)]
            after = conv[i + 1] if i + 1 < len(conv) else None
            if after is not None:
                end = now + lags.get(id(turn), 0.0)
                at = max(now, _next_arrival(after, end, think_s, workload.timed))
                heapq.heappush(events, (at, next(seq), "arrive", after))
            elif not workload.timed:
                nxt = next(pending, None)
                if nxt is not None:
                    heapq.heappush(events, (now + think_s, next(seq), "arrive", nxt[0]))
        eng.sample(now)
    eng.expire_until(math.inf)  # (what is still retained is held to its expiry)
    return out


def recorded_lags(workload: Workload, costs: CostModel) -> dict[int, float]:
    """Seconds each measured turn of a timed trace (by ``id``) really ended after the end
    the `costs` model gives it as recorded: its measured latency less the model's TTFT
    (with its recorded reuse, P's queue on the recorded arrivals) and decode. Negative:
    it ended before."""
    recorded = [
        t
        for t in workload.turns
        if workload.timed
        and t.arrival_s is not None
        and t.measured is not None
        and t.measured.ttft_ms is not None
    ]
    reused = [t.measured.reused_tokens if t.measured else 0 for t in recorded]
    ttfts = recorded_ttfts(recorded, costs, reused)
    return {
        id(t): (
            (t.measured.latency_ms if t.measured else 0.0)
            - ttft
            - costs.decode_ms_per_token * t.output_tokens
        )
        / 1e3
        for t, ttft in zip(recorded, ttfts, strict=True)
    }


def _all_conversations(workload: Workload) -> list[list[Turn]]:
    convs: dict[str, list[Turn]] = {}
    for t in workload.turns:
        convs.setdefault(t.conversation, []).append(t)
    return list(convs.values())


def _next_arrival(turn: Turn, previous_end: float, think_s: float, timed: bool) -> float:
    """When a conversation's next turn arrives, its previous one having ended at `previous_end`."""
    if turn.think_s is not None:
        return previous_end + turn.think_s
    if timed:  # (a client sends its next turn after the answer, at its time at the earliest)
        return max(turn.arrival_s or 0.0, previous_end)
    return previous_end + think_s

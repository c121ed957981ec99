"""A plan: every configuration replayed, the table, and the recommendation. Pure.

The recommendation: among the configurations whose hit rate is within `tolerance`
(absolute, 0.02 by default) of the best one's, and that never found D's pool full when
some configuration did not, the one holding the fewest block-seconds per reused token
(ties: the higher hit rate, then the shorter TTL). Memory bought for nothing shows as
block-seconds that reuse nothing more.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.costs import CostModel
from planner.simulate import Config, Outcome, simulate
from planner.traces import Workload

TOLERANCE = 0.02
"""How far below the best hit rate a recommended configuration may be (absolute)."""


@dataclass(frozen=True)
class Plan:
    """The outcomes of every configuration, and the no-reuse baseline."""

    workload: Workload
    costs: CostModel
    outcomes: tuple[Outcome, ...]
    baseline: Outcome
    think_s: float
    clients: int


def configurations(
    ttls: Sequence[float],
    thresholds: Sequence[int],
    budgets: Sequence[float],
    policies: Sequence[str],
    pool_blocks: int,
) -> list[Config]:
    """Every combination, each validated (ValueError names the bad one)."""
    configs = [
        Config(ttl, thr, budget, policy, pool_blocks)
        for ttl, thr, budget, policy in itertools.product(ttls, thresholds, budgets, policies)
    ]
    for c in configs:
        c.validate()
    return configs


def make_plan(
    workload: Workload, configs: Sequence[Config], costs: CostModel, think_s: float = 0.0, clients: int = 1
) -> Plan:
    """Replay `workload` under each configuration, and once with reuse off."""
    if not configs:
        raise ValueError("no configuration to plan")
    outcomes = tuple(simulate(workload, c, costs, think_s, clients) for c in configs)
    baseline = simulate(workload, replace(configs[0], reuse=False), costs, think_s, clients)
    return Plan(workload, costs, outcomes, baseline, think_s, clients)


def recommend(outcomes: Sequence[Outcome], tolerance: float = TOLERANCE) -> tuple[Outcome, str]:
    """The configuration to run, and why (see the module's docstring)."""
    best_hit = max(o.hit_rate for o in outcomes)
    near = [o for o in outcomes if o.hit_rate >= best_hit - tolerance]
    never_full = [o for o in near if o.pool_full == 0]
    pool = never_full or near
    choice = min(pool, key=lambda o: (o.block_seconds_per_reused_token, -o.hit_rate, o.config.ttl_s))
    why = (
        f"{choice.config.label}: the fewest block-seconds per reused token "
        f"({_num(choice.block_seconds_per_reused_token)}) among the configurations within "
        f"{tolerance:.0%} of the best hit rate ({best_hit:.1%})"
    )
    if never_full and len(never_full) < len(near):
        why += " that never found D's pool full"
    elif not never_full:
        why += f"; every one of them found D's pool full at times ({choice.pool_full} turns here)"
    return choice, why


def ttft_saved_ms(plan: Plan, outcome: Outcome) -> float:
    """Mean TTFT saved per turn against the same workload with reuse off."""
    return plan.baseline.ttft_mean_ms - outcome.ttft_mean_ms


LEGEND = (
    "blk-s/token: D's KV block-seconds held by retentions per reused token; saved/turn: mean TTFT "
    "saved against no reuse; peak use: D's pool at its fullest (over 100%: blocks D could not give, "
    "the turns would wait, then get a 503); full: turns that found D's pool full; early rel.: "
    "retentions released by the budget, to make room, or idle."
)
HEADER = (
    f"{'ttl s':>6} {'thr':>5} {'budget':>6} {'policy':>6} | {'hit rate':>8} {'reused tokens':>13} "
    f"{'blk-s/token':>11} | {'TTFT p50':>9} {'saved/turn':>10} | {'peak use':>9} {'full':>5} "
    f"{'early rel.':>10}"
)


def row(plan: Plan, o: Outcome) -> str:
    """One configuration's line of the table."""
    c = o.config
    early = o.releases["budget"] + o.releases["near_full"] + o.releases["idle"]
    return (
        f"{c.ttl_s:>6g} {c.threshold:>5} {c.budget:>6g} {c.policy:>6} | {o.hit_rate:>8.1%} "
        f"{o.reused_tokens:>13,} {_num(o.block_seconds_per_reused_token):>11} | "
        f"{o.ttft_p50_ms:>7.0f}ms {ttft_saved_ms(plan, o):>8.0f}ms | {o.peak_pressure:>9.0%} "
        f"{o.pool_full:>5} {early:>10}"
    )


def table(plan: Plan, tolerance: float = TOLERANCE) -> str:
    """The terminal report: the workload, the cost model, one row per configuration, and
    the recommendation."""
    w = plan.workload
    choice, why = recommend(plan.outcomes, tolerance)
    lines = [
        f"workload: {w.source}: {len(w.turns)} turns in {w.conversations} conversations "
        + ("(timed)" if w.timed else f"({plan.clients} clients, think {plan.think_s:g}s)"),
        f"cost model: {plan.costs.describe()}",
        f"D pool: {plan.outcomes[0].config.pool_blocks:,} blocks; no reuse: TTFT p50 "
        f"{plan.baseline.ttft_p50_ms:.0f}ms, peak use {plan.baseline.peak_pressure:.0%}",
        "",
        HEADER,
        *(row(plan, o) + ("  <-" if o is choice else "") for o in plan.outcomes),
        "",
        *textwrap.wrap(f"recommended: {why}", 100, subsequent_indent="  "),
        *textwrap.wrap(LEGEND, 100),
    ]
    return "\n".join(lines)


def _num(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:.3g}"

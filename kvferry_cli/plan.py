"""`kvferry plan TRACE`: what retention TTL, threshold, budget and policy buy on a trace.

Reads the trace (`planner.traces`), takes the cost model from flags (the emulator's
timing by default) or fits it to a kvferry trace (`planner.costs.fit`), replays every
combination of the listed values (`planner.simulate`), prints one row per
configuration and the recommendation, and with ``--report`` writes the HTML report
with its plots (`planner.html`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvferry import logs
from planner.costs import EMULATOR, CostModel, fit
from planner.report import TOLERANCE, configurations, make_plan, table
from planner.simulate import POLICIES
from planner.traces import FORMATS, TraceError, read_trace

T = TypeVar("T")


def _list_of(kind: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    def parse(text: str) -> list[T]:
        try:
            values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: a comma-separated list, not {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{what}: give at least one value")
        return values

    return parse


def _policies(text: str) -> list[str]:
    names = _list_of(str, "policies")(text)
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown policy {bad[0]!r}: one of {', '.join(POLICIES)}")
    return names


def add_arguments(sub: Any) -> None:
    """Add the `plan` command to the `kvferry` command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "plan",
        help="replay a multi-turn trace through a model of the engines and the retention policy",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit status: 0 done, 2 bad input (the trace, a flag)",
    )
    p.add_argument("trace", type=Path, help="the trace file")
    p.add_argument("--format", choices=FORMATS, default="kvferry", help="the trace's format")
    p.add_argument("--ttl", type=_list_of(float, "ttl"), default=[480.0, 240.0, 120.0], help="TTLs, s")
    p.add_argument("--threshold", type=_list_of(int, "threshold"), default=[64], help="recompute thresholds")
    p.add_argument("--budget", type=_list_of(float, "budget"), default=[1.0, 0.5], help="shares of D's pool")
    p.add_argument(
        "--policy",
        type=_policies,
        default=list(POLICIES),
        help="fixed (by age), value (the budget by value), idle (value and idle release: the "
        "daemon's defaults); comma-separated",
    )
    p.add_argument("--pool-blocks", type=int, default=4096, help="D's KV pool, blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--report", type=Path, help="write the HTML report (plots embedded) here")
    p.add_argument("--think", type=float, default=0.0, help="seconds between turns (untimed traces)")
    p.add_argument("--clients", type=int, default=1, help="conversations at a time (untimed traces)")
    p.add_argument(
        "--chars-per-token", type=float, default=4.0, help="vLLM conversations: characters a token"
    )
    p.add_argument("--seed", type=int, default=1, help="vLLM generation configs: the draws' seed")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="hit rate below the best still chosen")
    p.add_argument(
        "--fit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fit the cost model to the trace's measured TTFT (default: for kvferry traces)",
    )
    for name, default in EMULATOR.items():
        p.add_argument(
            f"--{name.replace('_', '-')}", type=float, default=default, help="the rate (or fit start)"
        )
    p.add_argument("--overhead-ms", type=float, default=0.0, help="per-turn time outside the engines")
    logs.add_level_flag(p, default=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """The `plan` command: -> its exit status."""
    try:
        workload = read_trace(a.trace, a.format, a.chars_per_token, a.seed)
        costs = CostModel(
            a.prefill_ms_per_token,
            a.transfer_ms_per_block,
            a.decode_ms_per_token,
            a.overhead_ms,
            a.block_size,
        )
        costs.validate()
        if a.fit if a.fit is not None else a.format == "kvferry":
            costs = fit(workload.turns, costs)
        configs = configurations(a.ttl, a.threshold, a.budget, a.policy, a.pool_blocks)
        if a.think < 0 or a.clients < 1 or not 0 <= a.tolerance < 1:
            raise ValueError("--think must be >= 0, --clients >= 1, --tolerance in [0, 1)")
        plan = make_plan(workload, configs, costs, a.think, a.clients)
    except (TraceError, ValueError) as e:
        print(f"kvferry plan: {e}", file=sys.stderr)
        return 2
    print(table(plan, a.tolerance))
    if a.report is not None:
        from planner.html import write_html

        try:
            write_html(plan, a.report, a.tolerance)
        except OSError as e:
            print(f"kvferry plan: cannot write {a.report}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"report: {a.report}")
    return 0

"""Reuse on a busy machine (issue 23, goal 3): of the turns that could pull, how many do.

The same multi-turn workload as bench.sustained (conversations arriving at a rate, each
running its turns through the router with think times), on a D whose pool never fills, in
two phases of one run: QUIET (a low rate: the baseline) and BUSY (a rate at which the
router, the engines, their sidecars, the daemon and etcd keep both cores saturated). A turn
after the first could pull (its conversation's last turn is retained on D); printed per
phase: the machine's CPU use (all cores, from /proc/stat), the share of those turns that
pulled and why the others did not (the router's X-Kvferry-Reuse answer), and TTFT p50 of
the later turns. The target: >= 95% pulled in the BUSY phase, with the cores >= 90% busy.

What rate saturates the cores depends on the machine: `--busy-rate` is where BUSY starts.
A BUSY phase that leaves the cores under 90% busy is run again at a rate scaled from the
two phases' CPU use to fill them (`next_rate`), up to `--busy-tries` phases; each is a
row, and the target is judged on the last.

    python -m bench.busy [--quiet-rate 1] [--busy-rate 40] [--busy-tries 3] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import statistics
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import parts
from bench.daemon_workload import DaemonProcess
from bench.demo import TurnRecord, wait_nodes
from bench.sustained import REFERENCE_BLOCKS, Shape, run_load
from kvferry import logs
from kvferry.tasks import run_main

TARGET_PULLED = 0.95
SATURATED = 0.90
AIM = 1.05
"""The CPU share `next_rate` aims at: past full, as the cores' share grows slower than the
load near saturation (queues form) and a phase a little short of 90% is one more phase."""
MOST_STEP = 2.0
"""`next_rate` at most doubles the rate: CPU use measured at a low rate extrapolates poorly."""


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class CpuWatch:
    """The machine's CPU use, sampled: the share of all cores busy in each interval."""

    shares: list[float] = field(default_factory=list)

    async def run(self, every_s: float = 0.5) -> None:
        busy0, total0 = _cpu_times()
        while True:
            await asyncio.sleep(every_s)
            busy, total = _cpu_times()
            if total > total0:
                self.shares.append((busy - busy0) / (total - total0))
            busy0, total0 = busy, total

    @property
    def median(self) -> float:
        return statistics.median(self.shares) if self.shares else 0.0


@dataclass
class Phase:
    name: str
    rate: float
    records: list[TurnRecord]
    cpu: CpuWatch

    @property
    def later(self) -> list[TurnRecord]:
        """The turns that could pull: every turn after a conversation's first that succeeded."""
        return [r for r in self.records if r.turn > 0 and r.status == 200]

    @property
    def pulled_share(self) -> float:
        later = self.later
        return sum(r.decision == "PULL" for r in later) / len(later) if later else 0.0

    @property
    def skips(self) -> str:
        reasons = collections.Counter(
            r.reason or r.decision or "(none)" for r in self.later if r.decision != "PULL"
        )
        return ", ".join(f"{why} {n}" for why, n in reasons.most_common(3)) or "-"

    @property
    def ttft_p50_ms(self) -> float:
        later = self.later
        return 1000 * statistics.median(r.ttft_s for r in later) if later else 0.0


@contextlib.asynccontextmanager
async def deployment() -> AsyncIterator[str]:
    """bench.demo's deployment (P's prefix cache off, D's pool never full), every part in a
    process of its own: the daemon, P and D each with its sidecar, the router; this process
    only sends the load. -> the router's URL."""
    with tempfile.TemporaryDirectory(prefix="kvferry-busy-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            daemon = DaemonProcess(Path(tmp) / "etcd")
            stack.push_async_callback(daemon.stop)
            await daemon.start()
            at = ("--daemon", daemon.address, "--daemon-stream", daemon.stream_address)
            await stack.enter_async_context(
                parts.started("engine", "--role", "prefill", "--no-prefix-caching", *at)
            )
            await stack.enter_async_context(
                parts.started("engine", "--role", "decode", "--num-blocks", str(REFERENCE_BLOCKS), *at)
            )
            await wait_nodes(daemon.address, 2)
            yield (await stack.enter_async_context(parts.started("router", *at))).url


async def one_phase(name: str, rate: float, args: argparse.Namespace) -> Phase:
    """`rate` new conversations a second for `args.seconds` on a fresh deployment."""
    async with deployment() as url:
        cpu = CpuWatch()
        watching = asyncio.create_task(cpu.run())
        try:
            records = await run_load(url, rate, args.seconds, Shape(turns=args.turns), args.seed)
        finally:
            watching.cancel()
    return Phase(name, rate, records, cpu)


def next_rate(quiet: Phase, busy: Phase) -> float:
    """The rate at which the cores would be AIM busy: CPU use taken as linear in the rate
    through the two phases (the quiet one sets what the idle parts cost), at least 10% more
    and at most MOST_STEP times `busy`'s rate. Whole conversations a second."""
    per_rate = (busy.cpu.median - quiet.cpu.median) / max(busy.rate - quiet.rate, 1e-9)
    wanted = busy.rate + (AIM - busy.cpu.median) / per_rate if per_rate > 0 else busy.rate * MOST_STEP
    return float(round(min(max(wanted, busy.rate * 1.1), busy.rate * MOST_STEP)))


def report(phases: Sequence[Phase]) -> str:
    head = (
        f"{'phase':<6} {'conv/s':>6} {'turns':>6} {'errors':>6} {'CPU busy':>8} "
        f"{'pulled/could':>13} {'share':>6} {'TTFT p50':>9}  skipped (top reasons)"
    )
    rows = []
    for p in phases:
        later = p.later
        pulled = sum(r.decision == "PULL" for r in later)
        errors = sum(r.status != 200 for r in p.records)
        rows.append(
            f"{p.name:<6} {p.rate:>6g} {len(p.records):>6} {errors:>6} {p.cpu.median:>8.0%} "
            f"{f'{pulled}/{len(later)}':>13} {p.pulled_share:>6.1%} {p.ttft_p50_ms:>7.1f}ms  {p.skips}"
        )
    return "\n".join([head, *rows])


async def main_async(args: argparse.Namespace) -> int:
    quiet = await one_phase("quiet", args.quiet_rate, args)
    busy = await one_phase("busy", args.busy_rate, args)
    phases = [quiet, busy]
    while busy.cpu.median < SATURATED and len(phases) <= args.busy_tries:
        busy = await one_phase("busy", next_rate(quiet, busy), args)
        phases.append(busy)
    print(
        f"reuse on a busy machine: {args.seconds:.0f} s of new conversations per phase, "
        f"{args.turns} turns each, D never full; CPU busy = median share of all cores"
    )
    print(report(phases))
    ratio = busy.pulled_share / quiet.pulled_share if quiet.pulled_share else 0.0
    met = busy.pulled_share >= TARGET_PULLED
    saturated = busy.cpu.median >= SATURATED
    print(
        f"busy/quiet pulled share: {ratio:.2f}; target (>= {TARGET_PULLED:.0%} pulled while the cores "
        f"are >= {SATURATED:.0%} busy): {'met' if met and saturated else 'NOT met'}"
        + (
            ""
            if saturated
            else f" (no busy phase saturated the cores in {args.busy_tries}: raise --busy-rate)"
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.busy", description=__doc__.split("\n")[0])
    p.add_argument("--quiet-rate", type=float, default=1.0, help="new conversations a second, quiet phase")
    p.add_argument("--busy-rate", type=float, default=40.0, help="new conversations a second, busy phase")
    p.add_argument("--busy-tries", type=int, default=3, help="busy phases at most, raising the rate")
    p.add_argument("--seconds", type=float, default=60.0, help="how long new conversations arrive, per phase")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    logs.configure("error")
    return run_main(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())

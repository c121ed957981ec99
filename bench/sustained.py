"""Sustained load through the router: what retention costs D's KV pool (issue 22).

New conversations arrive at ``--rate`` a second (Poisson) for ``--seconds``; each runs
``--turns`` turns through the router with think times between them, its context growing
every turn. The decode engine has ``--blocks`` KV blocks (the emulator's default 4,096).
Every conversation's last turn is retained on D for ``decoder_kv_blocks_ttl`` unless the
daemon releases it earlier, so with a fixed 480 s retention D's pool fills within seconds,
D makes requests wait and then answers 503, and clients see errors.

The same load runs twice: on D with ``--blocks``, and on a D whose pool is large enough
never to fill (the reference). Printed per run: turns, client errors, the turns that
pulled and the tokens they reused, D's highest pool use and the seconds it was full,
and the reused tokens as a share of the reference run's (the issue's target: >= 80%,
with 0 client errors and D never full).

    python -m bench.sustained [--rate 7] [--seconds 240] [--blocks 4096] [--daemon-args ...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.demo import Conversation, TurnRecord, _text, deployment, one_turn
from kvferry import logs
from kvferry.tasks import run_main

REFERENCE_BLOCKS = 1 << 20
"""D's pool in the reference run: more than the load ever pins."""
FULL = 0.99
"""Pool use counted as full."""
_USAGE = re.compile(rb"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


@dataclass(frozen=True)
class Shape:
    """The conversations: how many turns, how their context grows, how long users think."""

    turns: int = 4
    first_chars: int = 300
    """The first turn's task (byte tokens: one character, one token)."""
    growth_chars: tuple[int, int] = (100, 200)
    """What each later turn adds (a tool result), at random in this range."""
    think_s: tuple[float, float] = (0.5, 1.5)
    max_tokens: int = 16


def conversation(cid: str, shape: Shape, rng: random.Random) -> Conversation:
    return Conversation(
        cid=cid,
        system="You are a helpful agent.",
        task=_text(rng, shape.first_chars),
        tool_results=[_text(rng, rng.randint(*shape.growth_chars)) for _ in range(shape.turns)],
    )


@dataclass
class PoolWatch:
    """D's pool use, sampled from its /metrics."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    async def run(self, http: aiohttp.ClientSession, url: str, every_s: float = 0.5) -> None:
        while True:
            try:
                async with http.get(url + "/metrics") as r:
                    m = _USAGE.search(await r.read())
                if m:
                    self.samples.append((time.monotonic(), float(m.group(1))))
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(every_s)

    @property
    def highest(self) -> float:
        return max((u for _, u in self.samples), default=0.0)

    def seconds_full(self, every_s: float = 0.5) -> float:
        return every_s * sum(u >= FULL for _, u in self.samples)


@dataclass
class Result:
    blocks: int
    records: list[TurnRecord]
    pool: PoolWatch
    seconds: float

    @property
    def errors(self) -> int:
        return sum(r.status != 200 for r in self.records)

    @property
    def eligible(self) -> int:
        return sum(r.turn > 0 for r in self.records)

    @property
    def pulled(self) -> int:
        return sum(r.turn > 0 and r.decision == "PULL" for r in self.records)

    @property
    def reused(self) -> int:
        return sum(r.reused_tokens for r in self.records)


async def run_load(url: str, rate: float, seconds: float, shape: Shape, seed: int) -> list[TurnRecord]:
    """Conversations arriving at `rate`/s for `seconds`, each running all its turns."""
    rng = random.Random(seed)
    records: list[TurnRecord] = []
    running: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def converse(conv: Conversation, think: random.Random) -> None:
            for t in range(shape.turns):
                try:
                    rec = await one_turn(http, url, conv, t, shape.max_tokens)
                except (aiohttp.ClientError, TimeoutError) as e:
                    rec = TurnRecord(conv.cid, t, 0, 0.0, "", 0, str(e), 599)
                records.append(rec)
                if rec.status != 200:
                    return
                conv.answers.append(rec.answer)
                await asyncio.sleep(think.uniform(*shape.think_s))

        start = time.monotonic()
        at, i = start, 0
        while at < start + seconds:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            conv = conversation(f"s{seed}-{i}", shape, rng)
            task = asyncio.create_task(converse(conv, random.Random(rng.random())))
            running.add(task)
            task.add_done_callback(running.discard)
            at += rng.expovariate(rate)
            i += 1
        if running:
            await asyncio.gather(*running)
    return records


async def one_run(args: argparse.Namespace, blocks: int) -> Result:
    shape = Shape(turns=args.turns)
    d_changes = {"num_blocks": blocks, "decoder_kv_blocks_ttl": args.ttl}
    async with deployment(d_changes=d_changes, daemon_args=shlex.split(args.daemon_args)) as dep:
        pool = PoolWatch()
        async with aiohttp.ClientSession() as http:
            watching = asyncio.create_task(pool.run(http, dep.decode.http_url))
            t0 = time.monotonic()
            try:
                records = await run_load(dep.kvferry.url, args.rate, args.seconds, shape, args.seed)
            finally:
                watching.cancel()
            return Result(blocks, records, pool, time.monotonic() - t0)


def report(runs: Sequence[Result]) -> str:
    head = (
        f"{'D blocks':>9} {'turns':>6} {'errors':>6} {'pulled':>13} {'reused tokens':>13} "
        f"{'pool max':>8} {'full s':>6} {'reused/ref':>10}"
    )
    ref = runs[-1].reused or 1
    rows = [
        f"{r.blocks:>9} {len(r.records):>6} {r.errors:>6} {f'{r.pulled}/{r.eligible}':>13} {r.reused:>13} "
        f"{r.pool.highest:>8.2f} {r.pool.seconds_full():>6.1f} {r.reused / ref:>10.2f}"
        for r in runs
    ]
    return "\n".join([head, *rows])


async def main_async(args: argparse.Namespace) -> int:
    runs = [await one_run(args, args.blocks), await one_run(args, REFERENCE_BLOCKS)]
    print(
        f"sustained load: {args.rate} new conversations/s for {args.seconds:.0f} s, {args.turns} turns "
        f"each, D's TTL {args.ttl:.0f} s, daemon flags: {args.daemon_args or '(defaults)'}"
    )
    print(report(runs))
    tested = runs[0]
    ok = tested.errors == 0 and tested.pool.seconds_full() == 0 and tested.reused >= 0.8 * runs[1].reused
    print(f"target (0 errors, D never full, reused >= 80% of the reference): {'met' if ok else 'NOT met'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sustained", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=7.0, help="new conversations a second")
    p.add_argument("--seconds", type=float, default=240.0, help="how long new conversations arrive")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--blocks", type=int, default=4096, help="D's KV blocks (the emulator's default)")
    p.add_argument("--ttl", type=float, default=480.0, help="D's decoder_kv_blocks_ttl, seconds")
    p.add_argument("--daemon-args", default="", help="more `kvferry daemon` flags, one string")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    logs.configure("error")  # (a full D's refusals would bury the figures)
    return run_main(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())

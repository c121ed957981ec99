"""The engines' cost model, given or fitted from a kvferry trace. Pure.

A turn's time to first byte is modelled as

    TTFT = overhead + wait for P's GPU + prefill x computed tokens
           + transfer x (blocks P pulls from D + blocks D pulls from P),

the emulator's own timing model (`emulator.timing`: P computes what it did not pull,
one prefill at a time; the KV moves block by block) plus what the router's hops add
(tokenize, lookup, HTTP): `overhead_ms`. A turn ends ``decode x output tokens`` after
its first byte.

`fit` takes a kvferry trace (turns with and without reuse: the regressors computed
tokens and blocks moved are then not collinear) and finds the overhead, prefill and
transfer rates with the least absolute errors of the whole formula, P's queue included
(`p_waits`, on the trace's arrivals); decode comes from latency minus TTFT over output
tokens. A rate the data cannot pin down (negative, or a singular system) keeps the given
value.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvferry.retentionvalue import blocks_for
from planner.traces import Turn

EMULATOR = {"prefill_ms_per_token": 0.05, "transfer_ms_per_block": 0.05, "decode_ms_per_token": 2.0}
"""`make demo`'s emulator timing (bench/demo.py TIMING): the default rates."""


@dataclass(frozen=True)
class CostModel:
    """Measured (or assumed) rates of the engines."""

    prefill_ms_per_token: float = EMULATOR["prefill_ms_per_token"]
    transfer_ms_per_block: float = EMULATOR["transfer_ms_per_block"]
    decode_ms_per_token: float = EMULATOR["decode_ms_per_token"]
    overhead_ms: float = 0.0
    """Per turn, outside the engines' modelled work (router hops, tokenize, lookup)."""
    block_size: int = 16

    def validate(self) -> None:
        """ValueError on a negative or non-finite rate, or a block size < 1."""
        rates = (
            self.prefill_ms_per_token,
            self.transfer_ms_per_block,
            self.decode_ms_per_token,
            self.overhead_ms,
        )
        if not all(math.isfinite(r) and r >= 0 for r in rates):
            raise ValueError("cost rates must be finite and >= 0")
        if self.block_size < 1:
            raise ValueError("block size must be at least 1")

    def moved_blocks(self, prompt_tokens: int, reused_tokens: int) -> int:
        """Blocks a turn moves: those P pulls from D, and those D pulls from P."""
        return blocks_for(reused_tokens, self.block_size) + blocks_for(prompt_tokens, self.block_size)

    def describe(self) -> str:
        """One line for the report."""
        return (
            f"prefill {self.prefill_ms_per_token:.4g} ms/token, transfer {self.transfer_ms_per_block:.4g} "
            f"ms/block, decode {self.decode_ms_per_token:.4g} ms/token, overhead {self.overhead_ms:.4g} ms "
            f"(block {self.block_size})"
        )


def p_waits(turns: Sequence[Turn], model: CostModel, reused: Sequence[int]) -> list[float]:
    """Each turn's wait (ms) for P's GPU, one prefill at a time in arrival order."""
    free_at = -math.inf
    waits: list[float] = []
    for turn, r in zip(turns, reused, strict=True):
        ready = (
            (turn.arrival_s or 0.0) * 1e3
            + model.overhead_ms
            + model.transfer_ms_per_block * blocks_for(r, model.block_size)
        )
        start = max(ready, free_at)
        waits.append(start - ready)
        free_at = start + model.prefill_ms_per_token * max(1, turn.prompt_tokens - r)
    return waits


def recorded_ttfts(turns: Sequence[Turn], model: CostModel, reused: Sequence[int]) -> list[float]:
    """Each turn's TTFT (ms) as `model` has it, the turn arriving when the trace says and
    reusing `reused` tokens (its wait for P included)."""
    waits = p_waits(turns, model, reused)
    return [
        model.overhead_ms
        + wait
        + model.prefill_ms_per_token * max(1, t.prompt_tokens - r)
        + model.transfer_ms_per_block * model.moved_blocks(t.prompt_tokens, r)
        for t, r, wait in zip(turns, reused, waits, strict=True)
    ]


def fit(turns: Sequence[Turn], start: CostModel | None = None) -> CostModel:
    """Rates fitted to a kvferry trace's measured TTFT and latency (`start`: the fallback).

    The rates minimise the absolute errors of the whole model, P's queue included: the
    waits are computed from the rates being tried, on the trace's own arrivals, and the
    overhead is the median of what is left (least absolute deviations: the fitted model's
    errors have a median of zero, and a few slow turns, a first connection or a stall of a
    loaded machine, do not set the rates as they would a least-squares fit). The search
    (`_nelder_mead` over the logarithms of the prefill and transfer rates) starts from the
    linear fit without waits. (Fitting the linear part to the TTFT minus the waits of the
    previous rates, round by round, did not converge: a rate a little high made the
    modelled queue grow, and the next round's rate higher still.)"""
    model = start or CostModel()
    timed = [t for t in turns if t.measured is not None and t.measured.ttft_ms is not None]
    if len(timed) < 4:
        raise ValueError(f"a fit needs at least 4 turns with a measured TTFT; the trace has {len(timed)}")
    reused = [t.measured.reused_tokens if t.measured else 0 for t in timed]
    ttfts = [(t.measured.ttft_ms or 0.0) if t.measured else 0.0 for t in timed]
    rows = [
        (1.0, float(max(1, t.prompt_tokens - r)), float(model.moved_blocks(t.prompt_tokens, r)))
        for t, r in zip(timed, reused, strict=True)
    ]
    linear = _solve(model, rows, ttfts)
    if linear is not None:
        # (a transfer rate the linear fit kept, the data not pinning it down, stays kept)
        kept = linear.transfer_ms_per_block == model.transfer_ms_per_block
        model = _with_waits(linear, timed, reused, ttfts, transfer_free=not kept)
    return replace(model, decode_ms_per_token=_decode_rate(timed, model.decode_ms_per_token))


def _with_waits(
    linear: CostModel,
    turns: Sequence[Turn],
    reused: Sequence[int],
    ttfts: Sequence[float],
    transfer_free: bool,
) -> CostModel:
    """`linear` with the prefill rate (and the transfer rate when `transfer_free`) and the
    overhead minimising the absolute errors of TTFT = overhead + P's wait + prefill x
    computed + transfer x moved."""

    def at(logs: Sequence[float]) -> CostModel:
        transfer = math.exp(logs[1]) if transfer_free else linear.transfer_ms_per_block
        return replace(linear, prefill_ms_per_token=math.exp(logs[0]), transfer_ms_per_block=transfer)

    def errors(logs: Sequence[float]) -> tuple[float, float]:
        modelled = recorded_ttfts(turns, replace(at(logs), overhead_ms=0.0), reused)
        left = [y - m for y, m in zip(ttfts, modelled, strict=True)]
        overhead = max(0.0, statistics.median(left))
        return sum(abs(e - overhead) for e in left), overhead

    first = [math.log(linear.prefill_ms_per_token), math.log(max(linear.transfer_ms_per_block, 1e-6))]
    best = _nelder_mead(lambda x: errors(x)[0], first[: 1 + transfer_free], [0.2, 0.2][: 1 + transfer_free])
    return replace(at(best), overhead_ms=errors(best)[1])


def _nelder_mead(
    f: Callable[[Sequence[float]], float], x0: Sequence[float], steps: Sequence[float], iterations: int = 300
) -> list[float]:
    """The point near `x0` minimising `f` (the Nelder-Mead simplex; `steps`: its first size)."""
    n = len(x0)
    points = [list(x0)] + [[x + (steps[i] if j == i else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(p) for p in points]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        points, values = [points[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] <= 1e-9 * max(1.0, abs(values[0])):
            break
        centre = [sum(p[j] for p in points[:-1]) / n for j in range(n)]
        worst = points[-1]
        reflected = [c + (c - w) for c, w in zip(centre, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst, strict=True)]
            fe = f(expanded)
            points[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            points[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                points[-1], values[-1] = contracted, fc
            else:  # (shrink towards the best point)
                points = [
                    points[0],
                    *([b + 0.5 * (x - b) for b, x in zip(points[0], p, strict=True)] for p in points[1:]),
                ]
                values = [values[0], *(f(p) for p in points[1:])]
    return points[min(range(n + 1), key=values.__getitem__)]


L1_ROUNDS = 20
"""Reweighting rounds of the least-absolute-deviations fit."""


def _solve(model: CostModel, rows: list[tuple[float, float, float]], ys: list[float]) -> CostModel | None:
    """Overhead, prefill and transfer rates minimising the absolute errors (transfer kept
    at the given rate when the data do not pin it down)."""
    weights = [1.0] * len(rows)
    best: CostModel | None = None
    for _ in range(L1_ROUNDS):
        coef = least_squares(rows, ys, weights)
        if coef is None or coef[1] <= 0:
            break
        overhead, prefill, transfer = coef
        if transfer < 0:
            transfer = model.transfer_ms_per_block
            two = least_squares(
                [r[:2] for r in rows], [y - transfer * r[2] for r, y in zip(rows, ys, strict=True)], weights
            )
            if two is None or two[1] <= 0:
                break
            overhead, prefill = two
        best = replace(
            model,
            overhead_ms=max(0.0, overhead),
            prefill_ms_per_token=prefill,
            transfer_ms_per_block=transfer,
        )
        residuals = [
            abs(y - (best.overhead_ms + prefill * r[1] + transfer * r[2]))
            for r, y in zip(rows, ys, strict=True)
        ]
        weights = [1.0 / max(e, 1e-3) for e in residuals]
    return best


def _decode_rate(turns: Sequence[Turn], fallback: float) -> float:
    num = den = 0.0
    for t in turns:
        m = t.measured
        if m is None or m.ttft_ms is None or t.output_tokens <= 1:
            continue
        num += t.output_tokens * (m.latency_ms - m.ttft_ms)
        den += t.output_tokens**2
    return num / den if den > 0 and num > 0 else fallback


def least_squares(
    rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float] | None = None
) -> list[float] | None:
    """The x minimising sum w (A x - y)^2 (normal equations, Gaussian elimination); None if
    singular."""
    k = len(rows[0]) if rows else 0
    if k == 0 or len(rows) < k:
        return None
    w = weights or [1.0] * len(rows)
    # (columns scaled to unit size first: token counts and a constant differ by 1e4)
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [
        [
            sum(wi * r[i] * r[j] for r, wi in zip(rows, w, strict=True)) / (scale[i] * scale[j])
            for j in range(k)
        ]
        for i in range(k)
    ]
    b = [sum(wi * r[i] * y for r, y, wi in zip(rows, ys, w, strict=True)) / scale[i] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-9:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] / scale[i] for i in range(k)]

"""The engines' cost model, given or fitted from a kvferry trace. Pure.

A turn's time to first byte is modelled as

    TTFT = overhead + wait for P's GPU + prefill x computed tokens
           + transfer x (blocks P pulls from D + blocks D pulls from P),

the emulator's own timing model (`emulator.timing`: P computes what it did not pull,
one prefill at a time; the KV moves block by block) plus what the router's hops add
(tokenize, lookup, HTTP): `overhead_ms`. A turn ends ``decode x output tokens`` after
its first byte.

`fit` takes a kvferry trace (turns with and without reuse: the regressors computed
tokens and blocks moved are then not collinear) and solves the least squares for the
overhead, prefill and transfer rates, subtracting P's queueing as the current estimate
predicts it (three rounds); decode comes from latency minus TTFT over output tokens.
A rate the data cannot pin down (negative, or a singular system) keeps the given value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.traces import Turn
from planner.value import blocks_for

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


def fit(turns: Sequence[Turn], start: CostModel | None = None, rounds: int = 3) -> CostModel:
    """Rates fitted to a kvferry trace's measured TTFT and latency (`start`: the fallback).

    Least absolute deviations (iteratively reweighted least squares): the fitted model's
    errors have a median of zero, so its TTFT percentiles follow the measured ones, and a
    few slow turns (a first connection, a stall of a loaded machine) do not set the rates
    as they would a least-squares fit."""
    model = start or CostModel()
    timed = [t for t in turns if t.measured is not None and t.measured.ttft_ms is not None]
    if len(timed) < 4:
        raise ValueError(f"a fit needs at least 4 turns with a measured TTFT; the trace has {len(timed)}")
    reused = [t.measured.reused_tokens if t.measured else 0 for t in timed]
    for _ in range(rounds):
        waits = p_waits(timed, model, reused)
        rows = [
            (1.0, float(max(1, t.prompt_tokens - r)), float(model.moved_blocks(t.prompt_tokens, r)))
            for t, r in zip(timed, reused, strict=True)
        ]
        ys = [
            (t.measured.ttft_ms or 0.0) - w if t.measured else 0.0 for t, w in zip(timed, waits, strict=True)
        ]
        fitted = _solve(model, rows, ys)
        if fitted is None:
            break
        model = fitted
    return replace(model, decode_ms_per_token=_decode_rate(timed, model.decode_ms_per_token))


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

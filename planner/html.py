"""The HTML report of a plan: the table, the recommendation and its plots (PNG, embedded).

matplotlib with its Agg backend (no display needed); the one module of the planner that
writes a file.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from planner.report import Plan, recommend, table

_MAX_POINTS = 2000
"""Points per pool-pressure line (the simulation samples every event)."""


def write_html(plan: Plan, path: Path, tolerance: float) -> None:
    """Write the report to `path` (OSError when it cannot be)."""
    figures = [_pressure(plan), _trade(plan), _ttft(plan)]
    images = "\n".join(
        f'<p><img alt="{alt}" src="data:image/png;base64,{_png(fig)}"></p>' for alt, fig in figures
    )
    _, why = recommend(plan.outcomes, tolerance)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvferry plan</title>
<style>body{{font-family:sans-serif;margin:2em}} pre{{background:#f6f6f6;padding:1em}}</style></head>
<body><h1>kvferry plan</h1>
<p><b>Recommended:</b> {html.escape(why)}</p>
<pre>{html.escape(table(plan, tolerance))}</pre>
{images}
</body></html>
"""
    path.write_text(page, encoding="utf-8")


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _pressure(plan: Plan) -> tuple[str, Figure]:
    fig, ax = plt.subplots(figsize=(9, 4))
    for o in plan.outcomes:
        step = max(1, len(o.pressure) // _MAX_POINTS)
        pts = o.pressure[::step]
        ax.plot([t for t, _, _ in pts], [p * 100 for _, p, _ in pts], label=o.config.label, linewidth=1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("D pool in use, %")
    ax.set_title("D pool pressure over time (running requests and retentions)")
    ax.legend(fontsize="x-small")
    return "D pool pressure over time", fig


def _trade(plan: Plan) -> tuple[str, Figure]:
    fig, ax = plt.subplots(figsize=(9, 4))
    for o in plan.outcomes:
        cost = o.block_seconds_per_reused_token
        ax.scatter([cost if cost != float("inf") else 0], [o.hit_rate * 100])
        ax.annotate(
            o.config.label, (cost if cost != float("inf") else 0, o.hit_rate * 100), fontsize="x-small"
        )
    ax.set_xlabel("block-seconds held per reused token")
    ax.set_ylabel("hit rate, %")
    ax.set_title("What the memory buys: hit rate against block-seconds per reused token")
    return "hit rate against block-seconds per reused token", fig


def _ttft(plan: Plan) -> tuple[str, Figure]:
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, o in [("no reuse", plan.baseline), *((o.config.label, o) for o in plan.outcomes)]:
        xs = sorted(r.ttft_ms for r in o.turns)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, linewidth=1)
    ax.set_xlabel("predicted TTFT, ms")
    ax.set_ylabel("share of turns")
    ax.set_title("Predicted TTFT (CDF)")
    ax.legend(fontsize="x-small")
    return "predicted TTFT CDF", fig

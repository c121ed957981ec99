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
from planner.simulate import Outcome

_MAX_POINTS = 2000
"""Points per pool-pressure line (the simulation samples every event)."""


def write_html(plan: Plan, path: Path, tolerance: float) -> None:
    """Write the report to `path` (OSError when it cannot be)."""
    chosen, why = recommend(plan.outcomes, tolerance)
    figures = [_pressure(plan), _trade(plan, chosen), _ttft(plan)]
    images = "\n".join(
        f'<p><img alt="{alt}" src="data:image/png;base64,{_png(fig)}"></p>' for alt, fig in figures
    )
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


_STYLES = {"fixed": "-", "value": "--", "idle": ":"}
"""Line style per policy: configurations differing only by policy often coincide."""


def _colour(i: int) -> tuple[float, float, float, float]:
    return plt.get_cmap("tab20")(i % 20)


def _pressure(plan: Plan) -> tuple[str, Figure]:
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, o in enumerate(plan.outcomes):
        step = max(1, len(o.pressure) // _MAX_POINTS)
        pts = o.pressure[::step]
        ax.plot(
            [t for t, _, _ in pts],
            [p * 100 for _, p, _ in pts],
            label=o.config.label,
            linewidth=1,
            color=_colour(i),
            linestyle=_STYLES.get(o.config.policy, "-"),
        )
    ax.axhline(100, color="grey", linewidth=0.5)
    ax.set_xlabel("seconds")
    ax.set_ylabel("D pool in use, %")
    ax.set_title("D pool pressure over time (running requests and retentions)")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return "D pool pressure over time", fig


def _trade(plan: Plan, chosen: Outcome) -> tuple[str, Figure]:
    """One bar per configuration: block-seconds per reused token (log scale), hit rate at
    its end; the recommended one in another colour."""
    outcomes = list(plan.outcomes)
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.28 * len(outcomes)))
    costs = [o.block_seconds_per_reused_token for o in outcomes]
    finite = [c for c in costs if c != float("inf") and c > 0] or [1.0]
    shown = [c if c != float("inf") and c > 0 else min(finite) for c in costs]
    ys = range(len(outcomes))
    ax.barh(ys, shown, color=["tab:orange" if o is chosen else "tab:blue" for o in outcomes])
    for y, c, o in zip(ys, shown, outcomes, strict=True):
        ax.text(c, y, f"  hit {o.hit_rate:.1%}", va="center", fontsize="x-small")
    ax.set_yticks(list(ys), [o.config.label for o in outcomes], fontsize="x-small")
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(shown) * 6)
    ax.set_xlabel("block-seconds held per reused token (log)")
    ax.set_title("What the memory buys: block-seconds per reused token, and the hit rate")
    return "block-seconds per reused token and hit rate per configuration", fig


def _ttft(plan: Plan) -> tuple[str, Figure]:
    fig, ax = plt.subplots(figsize=(9, 4))
    lines = [("no reuse", plan.baseline), *((o.config.label, o) for o in plan.outcomes)]
    for i, (label, o) in enumerate(lines):
        xs = sorted(r.ttft_ms for r in o.turns)
        style = _STYLES.get(o.config.policy, "-") if i else "-"
        colour = "black" if not i else _colour(i - 1)
        ax.plot(
            xs,
            [(k + 1) / len(xs) for k in range(len(xs))],
            label=label,
            linewidth=1,
            color=colour,
            linestyle=style,
        )
    ax.set_xlabel("predicted TTFT, ms")
    ax.set_ylabel("share of turns")
    ax.set_title("Predicted TTFT (CDF)")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return "predicted TTFT CDF", fig

"""The planner's check against the emulator (issue 22): its prediction for a `make demo`-shaped
workload is within 10% of what the emulated run measures (hit rate, reused tokens, TTFT p50).

One deployment as `make demo` starts it (`bench.demo.deployment`: the daemon, P and D
emulators with `bench.demo.TIMING`, sidecars) and a router recording its turns
(``--trace-out``). The demo's agent conversations run through it (`bench.demo.run_workload`,
its clients and think time); the planner fits its cost model to the run's trace
(`planner.costs.fit`: the rates this machine delivered during the run) and replays the trace
(its sizes and think times; the reuse and the TTFT are the model's) under the deployment's
retention settings. Hit rate and reused tokens are compared with what the clients got,
the TTFT p50 with the router's (the time from its request to its first byte, what the
model is fitted to); the clients' is printed beside it, 1-4% above the router's: their
own share (encoding the request, the HTTP hop, parsing the stream) no router trace sees.

Why the rates are fitted to the same run: on a shared 2-core machine the emulated engines'
speed moves with the other processes' load (the emulator's modelled time is a floor; its
own CPU work comes on top). Rates fitted to an earlier run of the same workload predicted
this run's TTFT p50 within 4-25% in quiet periods, and 3x too high when a load spike hit
the earlier run. The runs themselves differ: 8 runs of this workload, 4 of them with a
busy loop on one core, measured TTFT p50 between 185 and 227 ms.

What the TTFT p50 depends on, and how the model keeps to the run: two clients share P,
which prefills one prompt at a time, so 30-45% of the turns wait for it. The fit models
that queue with the rates it tries, on the trace's arrivals; the replay keeps the
recorded arrivals (each turn's recorded lag behind the model's end for it,
`planner.simulate.recorded_lags`), so it models the same queue. And a loaded machine
makes the router skip lookups at its deadline (1-5 of the 40 turns at a load average of
7-10): the replay skips those too (`planner.traces.Measured.skipped_for_the_run`), as no
retention setting changes them. Before, the fit ran round by round and sometimes away (a
prefill rate of 0.08-0.12 ms/token against the emulator's 0.05), the replay queued P on
a timeline of its own, whose turns drifted by 17-113 ms on average from the recorded
ones, and it pulled where the run had skipped: over 12 recorded runs (quiet, a busy loop
on one core, and that with the other helpers' load) the prediction was -5% to +130% off
the clients' p50, and its hit rate 0.80 where a run's was 0.70. Now it is -5% to +2% off
the router's p50, the hit rates equal (the replay within 1% of the model on the recorded
arrivals in 11 of the 12). What is left is the fit's error (its median error is zero, the
median of its predictions within 5% of the measured one in those runs), and that grows
with the machine's stalls: at load averages of 8-12 (the other helpers and a busy loop),
runs of the same workload measured TTFT p50 from 188 to 269 ms, single turns up to 400 ms
above the model (a stall only adds), and the prediction ran -7% to +3% off the router's
p50 in 9 of 10 such runs, -19% in one.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from bench import demo
from planner.costs import fit
from planner.simulate import Config, simulate
from planner.traces import read_trace
from router import Router

CONVERSATIONS, TURNS, CLIENTS = 8, 5, 2
D_TTL_S = 300.0  # (bench.demo's decoder_kv_blocks_ttl: D's blocks outlive no retention)


def _within(predicted: float, measured: float, share: float = 0.10) -> bool:
    return abs(predicted - measured) <= share * measured


async def test_the_planner_predicts_the_demo_workload(tmp_path: Path) -> None:
    pool = CONVERSATIONS * TURNS * (TURNS * 2600 + 2000) // 16 + 8192  # (as bench.demo sizes D)
    d_changes = {**demo.TIMING, "num_blocks": pool, "decoder_kv_blocks_ttl": D_TTL_S}
    trace = tmp_path / "demo.jsonl"
    async with demo.deployment(demo.TIMING, d_changes) as dep:
        s = demo.router_settings(dep.daemon.address)
        s = dataclasses.replace(s, server=dataclasses.replace(s.server, trace_out=str(trace)))
        async with Router(s) as router:
            conversations = demo.agent_conversations(CONVERSATIONS, TURNS, seed=1)
            measured = await demo.run_workload(router.url, conversations, TURNS, CLIENTS)
    assert all(r.status == 200 for r in measured)

    workload = read_trace(trace, "kvferry")
    assert len(workload.turns) == CONVERSATIONS * TURNS
    costs = fit(workload.turns)
    predicted = simulate(workload, Config(ttl_s=D_TTL_S, threshold=64, pool_blocks=pool), costs)

    hit_rate = sum(r.decision == "PULL" for r in measured) / len(measured)
    reused = sum(r.reused_tokens for r in measured)
    ttft_p50 = statistics.median(t.measured.ttft_ms or 0.0 for t in workload.turns if t.measured)
    clients_p50 = statistics.median(r.ttft_s * 1e3 for r in measured)
    figures = (
        f"hit rate {predicted.hit_rate:.3f} vs {hit_rate:.3f}; reused {predicted.reused_tokens} vs {reused}; "
        f"TTFT p50 {predicted.ttft_p50_ms:.1f} vs {ttft_p50:.1f} ms (the clients' {clients_p50:.1f}); "
        f"costs {costs.describe()}"
    )
    print(figures)
    assert _within(predicted.hit_rate, hit_rate), figures
    assert _within(predicted.reused_tokens, reused), figures
    assert _within(predicted.ttft_p50_ms, ttft_p50), figures

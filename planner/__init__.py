"""`kvferry plan`: what a retention TTL, threshold, budget and policy buy, on a replayed trace.

- `planner.traces`: the trace readers (vLLM's multi-turn benchmark conversations and its
  generation config, Mooncake-style timestamped JSONL, the router's own ``--trace-out``),
  all into one `Workload`.
- `planner.costs`: the engines' cost model (prefill ms/token, transfer ms/block, decode
  ms/token, a fixed overhead), fitted to a kvferry trace (P's queue included) or given.
- `planner.value`: the return-interval learner of a replay, for the retention value rule
  the daemon applies (`kvferry.retentionvalue`: reusable tokens x P(return before
  expiry) per block-second, and the idle release).
- `planner.simulate`: the event simulation of P, D's pool and the retention policy.
- `planner.report`: the terminal table, the recommendation, the HTML report with plots.

Pure and deterministic, apart from `planner.report` writing its file.
"""

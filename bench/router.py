"""Router benchmark: what the router adds to a turn, and what reuse saves.

1. Overhead. TTFT of the same P-then-D sequence issued directly by the client
   (P itself, then D's sidecar: the router's path), through the kvferry router
   (plain P/D: no conversation id), and through an aiohttp stand-in for vLLM's example
   multi-turn proxy (``examples/disaggregated/disaggregated_serving/
   disagg_proxy_multiturn.py``), all against the same engines in the same run,
   interleaved, one request at a time. Engines with no simulated delays, so
   the differences are the hops. Then the same as a conversation's first turn
   through kvferry (the router tokenizes, digests and looks up, nothing is held;
   D's sidecar captures the answer) and through the stand-in (its cache looked
   at). The reuse path's own work (tokenize, digests, lookup) is also reported
   from the router's stage histograms.

   The stand-in re-creates that proxy's per-request structure, not its code:
   the body parsed and re-serialized with the stdlib ``json`` for P and again
   for D, P's answer parsed, D's stream relayed line by line with every
   ``data:`` line parsed (to capture ``kv_transfer_params``) and each line
   written on its own. The original runs on FastAPI/uvicorn with httpx, which
   cost more per request than aiohttp; so the stand-in's figure is a lower
   bound of the original's.

2. Emulated TTFT speedup at 8k, 32k and 64k-token contexts: turn 2 of a
   conversation through kvferry vs the same turn with reuse off, on engines
   with the timing model (prefill 0.05 ms/token, KV transfer 0.05 ms/block,
   decode 2 ms/token). The ideal speedup is the ratio of the model's costs for
   what the engines did (computed tokens and transferred blocks, read off their
   metrics around each request) with reuse off and with the fullest correct reuse
   of the turn (kvferry's, or another path's if it pulled more); efficiency =
   measured / ideal. The same turn sent by the client itself, P then D's sidecar with D's
   last params and no front door at all, bounds what any router can reach here. Each
   front door (kvferry's routers, reuse off's, the stand-in) runs in a process of its
   own, as in a deployment; the engines, sidecars and client share the bench's.

    python -m bench.router [--requests 300] [--repeats 9] [--only overhead|speedup]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.router_overhead import overhead
from bench.router_speedup import speedup
from kvferry import logs
from kvferry.tasks import run_main


async def main_async(args: argparse.Namespace) -> int:
    print(f"kvferry router benchmark ({'uvloop' if args.uvloop else 'asyncio'}; everything on this machine)")
    if args.only in ("", "overhead"):
        await overhead(args.requests, args.prompt_chars)
    if args.only in ("", "speedup"):
        await speedup(args.lengths, args.repeats)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="requests per path in the overhead test")
    p.add_argument("--prompt-chars", type=int, default=2000, help="prompt size in the overhead test")
    p.add_argument(
        "--repeats", type=int, default=9, help="conversations per context length (up to 3x at shorter ones)"
    )
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 65536])
    p.add_argument("--only", choices=("overhead", "speedup"), default="", help="run one section")
    p.add_argument("--no-uvloop", dest="uvloop", action="store_false")
    args = p.parse_args(argv)
    logs.configure("warning")
    return run_main(main_async(args), use_uvloop=args.uvloop)


if __name__ == "__main__":
    raise SystemExit(main())

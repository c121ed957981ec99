"""``make demo``: KV reuse across turns of agent conversations, measured on one machine.

Starts everything on loopback: ``kvferry daemon`` on its embedded etcd (its own
process, data in a temporary directory), one prefill and one decode engine
emulator with a sidecar each (P's local prefix cache off, as in the published
measurement), and the router. Then runs a multi-turn agent workload — each turn
the context grows by the model's answer and a tool result — twice: once
through kvferry, once with reuse off (the same router, ``--reuse false``), and
prints per context-length band the TTFT with and without reuse, the speedup,
the share of turns that pulled the previous turn's KV, the tokens reused, and
how many answers differed from the no-reuse run (the emulator's answers depend
on every KV slot, so a wrong pull would show here; it must be 0).

The emulator's timing model makes prefill expensive, as on a GPU: prefill
0.05 ms/token, KV transfer 0.05 ms/block, decode 2 ms/token.

    python -m bench.demo [--conversations 8] [--turns 10] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.daemon_workload import DaemonProcess
from emulator import EmulatorConfig, EmulatorServer
from kvferry import logs
from kvferry.tasks import run_main
from kvferry.v1 import nodes_pb2, nodes_pb2_grpc
from router import Router
from router import Settings as RouterSettings
from router.settings import DaemonSettings, ReuseSettings, ServerSettings
from sidecar import Settings as SidecarSettings
from sidecar import Sidecar
from sidecar.settings import DaemonSettings as SidecarDaemonSettings
from sidecar.settings import EngineSettings, TapSettings

TIMING = {"prefill_ms_per_token": 0.05, "transfer_ms_per_block": 0.05, "decode_ms_per_token": 2.0}
BANDS = ((0, 4096, "< 4k"), (4096, 8192, "4k-8k"), (8192, 16384, "8k-16k"), (16384, 32768, "16k-32k"))
BANDS_LONG = (*BANDS, (32768, 1 << 30, ">= 32k"))


def timing_text() -> str:
    t = TIMING
    return (
        f"prefill {t['prefill_ms_per_token']} ms/token, transfer {t['transfer_ms_per_block']} ms/block, "
        f"decode {t['decode_ms_per_token']} ms/token"
    )


# -- the deployment ---------------------------------------------------------------------------


def engine_config(role: str, **changes: Any) -> EmulatorConfig:
    return EmulatorConfig(
        host="127.0.0.1",
        port=0,
        role=role,  # type: ignore[arg-type]
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        max_model_len=131072,
        # (vLLM with PR 40186: a stream's final chunk carries D's params, so streamed turns
        # are retained; 0.32 without it gets no reuse on streamed turns, shown apart by the
        # scenario suite and bench.real_vllm)
        **{"stream_kv_transfer_params": True, **changes},
    )


def sidecar_settings(
    emu: EmulatorServer, daemon: str | tuple[str, ...], role: str, stream: str = "", **engine: Any
) -> SidecarSettings:
    """The sidecar of `emu` on loopback, reaching the daemon replica(s) `daemon` (registering
    over the framed stream at `stream`, when given); `engine` changes its EngineSettings
    (the engine's blocks TTL, say)."""
    return SidecarSettings(
        engine=EngineSettings(
            url=emu.http_url,
            engine_id=f"{role}-0",
            role=role,
            side_channel_host="127.0.0.1",
            side_channel_port=emu.side_channel_port,
            health_interval_s=0.5,
            **engine,
        ),
        daemon=SidecarDaemonSettings(
            addresses=(daemon,) if isinstance(daemon, str) else daemon,
            stream_addresses=(stream,) if stream else (),
        ),
        tap=TapSettings(listen="127.0.0.1:0"),
    )


def router_settings(daemon: str, reuse: bool = True, stream: str = "") -> RouterSettings:
    """A router of the daemon at `daemon`, looking up over its framed stream at `stream`
    ("": over gRPC)."""
    return RouterSettings(
        server=ServerSettings(listen="127.0.0.1:0"),
        daemon=DaemonSettings(
            addresses=(daemon,), stream_addresses=(stream,) if stream else (), nodes_refresh_s=0.5
        ),
        reuse=ReuseSettings(enabled=reuse),
    )


@dataclass
class Deployment:
    daemon: DaemonProcess
    prefill: EmulatorServer
    decode: EmulatorServer
    sidecars: list[Sidecar]
    kvferry: Router
    plain: Router
    """The same router with reuse off."""


@contextlib.asynccontextmanager
async def deployment(
    p_changes: dict[str, Any] | None = None,
    d_changes: dict[str, Any] | None = None,
    daemon_args: Sequence[str] = (),
) -> AsyncIterator[Deployment]:
    """Daemon (with `daemon_args`), P and D engines with sidecars, a router with reuse and
    one without."""
    with tempfile.TemporaryDirectory(prefix="kvferry-demo-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            daemon = DaemonProcess(Path(tmp) / "etcd", args=daemon_args)
            stack.push_async_callback(daemon.stop)
            await daemon.start()
            p = EmulatorServer(engine_config("prefill", enable_prefix_caching=False, **(p_changes or {})))
            d = EmulatorServer(engine_config("decode", **(d_changes or {})))
            sidecars = []
            for emu, role in ((p, "prefill"), (d, "decode")):
                await stack.enter_async_context(emu)
                sidecars.append(
                    await stack.enter_async_context(
                        Sidecar(sidecar_settings(emu, daemon.address, role, daemon.stream_address))
                    )
                )
            await wait_nodes(daemon.address, 2)
            kvferry = await stack.enter_async_context(
                Router(router_settings(daemon.address, stream=daemon.stream_address))
            )
            plain = await stack.enter_async_context(Router(router_settings(daemon.address, reuse=False)))
            yield Deployment(daemon, p, d, sidecars, kvferry, plain)


async def wait_nodes(address: str, count: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel, asyncio.timeout(30):
        stub = nodes_pb2_grpc.NodesStub(channel)
        while True:
            listed = await stub.List(nodes_pb2.ListNodesRequest())
            if sum(n.alive for n in listed.nodes) >= count:
                return
            await asyncio.sleep(0.1)


# -- the workload -----------------------------------------------------------------------------

_WORDS = (
    *("def", "class", "return", "import", "self", "config", "value", "error", "None", "True"),
    *("request", "block", "token", "cache", "node", "lease", "prefix", "decode", "prefill"),
    *("stream", "await", "async", "raise", "yield", "assert", "path", "file", "line"),
)


def _text(rng: random.Random, chars: int) -> str:
    lines, size = [], 0
    while size < chars:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]


@dataclass
class Conversation:
    """An agent session: instructions, a task, then one tool result per turn."""

    cid: str
    system: str
    task: str
    tool_results: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
        for i in range(turn):
            out.append({"role": "assistant", "content": self.answers[i]})
            out.append({"role": "tool", "content": self.tool_results[i]})
        return out


def agent_conversations(n: int, turns: int, seed: int = 1) -> list[Conversation]:
    """Conversations whose context grows by ~2.5k tokens per turn (byte tokens: 1 char, 1 token)."""
    rng = random.Random(seed)
    system = "You are a coding agent. Use the tools; read every file before changing it.\n" + _text(rng, 1500)
    return [
        Conversation(
            cid=f"agent-{i}",
            system=system,
            task=f"Task {i}: fix the failing test in module {i}.\n" + _text(rng, 300),
            tool_results=[
                f"$ cat file_{i}_{t}.py\n" + _text(rng, rng.randint(1500, 3500)) for t in range(turns)
            ],
        )
        for i in range(n)
    ]


@dataclass
class TurnRecord:
    cid: str
    turn: int
    prompt_tokens: int
    ttft_s: float
    decision: str
    reused_tokens: int
    answer: str
    status: int
    reason: str = ""
    """Why the turn did not pull (the router's X-Kvferry-Reuse-Reason), when it did not."""


async def one_turn(
    http: aiohttp.ClientSession, url: str, conv: Conversation, turn: int, max_tokens: int
) -> TurnRecord:
    body = {
        "model": "kvferry/emulated-model",
        "messages": conv.messages(turn),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "conversation_id": conv.cid,
    }
    t0 = time.perf_counter()
    ttft, prompt_tokens = 0.0, 0
    text: list[str] = []
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return TurnRecord(conv.cid, turn, 0, 0.0, "", 0, await r.text(), r.status)
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if not text:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
        return TurnRecord(
            conv.cid,
            turn,
            prompt_tokens,
            ttft,
            r.headers.get("X-Kvferry-Reuse", ""),
            int(r.headers.get("X-Kvferry-Reused-Tokens", "0")),
            "".join(text),
            r.status,
            r.headers.get("X-Kvferry-Reuse-Reason", ""),
        )


THINK_S = 0.05
"""`make demo`'s think time: the agent's tool runs for 50 ms after each turn."""


async def run_workload(
    url: str,
    conversations: Sequence[Conversation],
    turns: int,
    clients: int,
    think_s: Callable[[int], float] = lambda turn: THINK_S,
    max_tokens: int = 48,
) -> list[TurnRecord]:
    """Each client takes conversations one at a time and runs all their turns, waiting
    ``think_s(t)`` seconds after turn `t` (from 0) of a conversation before its next turn
    (or the next conversation)."""
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for c in conversations:
        c.answers.clear()
        queue.put_nowait(c)
    records: list[TurnRecord] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def client() -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                for t in range(turns):
                    rec = await one_turn(http, url, conv, t, max_tokens)
                    records.append(rec)
                    conv.answers.append(rec.answer)
                    await asyncio.sleep(think_s(t))  # the tool runs

        await asyncio.gather(*(client() for _ in range(clients)))
    return records


# -- the report -------------------------------------------------------------------------------


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


def report(
    with_reuse: list[TurnRecord], without: list[TurnRecord], bands: Sequence[tuple[int, int, str]]
) -> str:
    # Failed turns (counted in the summary) have no TTFT: they stay out of the table.
    base = {(r.cid, r.turn): r for r in without if r.status == 200}
    rows = [
        f"{'context':>9} {'turns':>5} | {'TTFT p50 off':>12} {'p50 kvferry':>11} {'speedup':>7} | "
        f"{'TTFT p90 off':>12} {'p90 kvferry':>11} {'speedup':>7} | {'pulled':>6} {'tokens reused':>13} "
        f"{'differ':>6}"
    ]
    for lo, hi, label in [*bands, (0, 1 << 30, "all")]:
        on = [r for r in with_reuse if r.status == 200 and lo <= r.prompt_tokens < hi]
        off = [base[(r.cid, r.turn)] for r in on if (r.cid, r.turn) in base]
        if not on:
            continue
        on_t = [r.ttft_s * 1e3 for r in on]
        off_t = [r.ttft_s * 1e3 for r in off]
        pulled = sum(r.decision == "PULL" for r in on) / len(on)
        reused = sum(r.reused_tokens for r in on)
        differ = sum(r.answer != base[(r.cid, r.turn)].answer for r in on if (r.cid, r.turn) in base)
        p50_off, p50_on, p90_off, p90_on = pct(off_t, 50), pct(on_t, 50), pct(off_t, 90), pct(on_t, 90)
        rows.append(
            f"{label:>9} {len(on):>5} | {p50_off:>10.0f}ms {p50_on:>9.0f}ms {p50_off / p50_on:>6.1f}x | "
            f"{p90_off:>10.0f}ms {p90_on:>9.0f}ms {p90_off / p90_on:>6.1f}x | {pulled:>6.0%} {reused:>13,} "
            f"{differ:>6}"
        )
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    conversations = agent_conversations(args.conversations, args.turns, args.seed)
    print(
        f"kvferry demo: {args.conversations} agent conversations x {args.turns} turns, "
        f"{args.clients} clients; emulated engines: {timing_text()}",
        flush=True,
    )
    d_blocks = args.conversations * args.turns * (args.turns * 2600 + 2000) // 16 + 8192
    async with deployment(TIMING, {**TIMING, "num_blocks": d_blocks, "decoder_kv_blocks_ttl": 300.0}) as dep:
        print("  running through kvferry ...", flush=True)
        with_reuse = await run_workload(dep.kvferry.url, conversations, args.turns, args.clients)
        print("  running with reuse off ...", flush=True)
        without = await run_workload(dep.plain.url, conversations, args.turns, args.clients)
        # Reads of D's blocks no longer held for the request: a retention handed out twice
        # (or after its deadline); the engine serves them silently, as vLLM does.
        stale = int(dep.decode.engine.metrics.total("kvferry_emulator:kv_reads_unheld"))
        # What P really pulled (the table's "tokens reused" is what the daemon handed out).
        p_pulled = int(dep.prefill.engine.metrics.total("kvferry_emulator:kv_pulled_tokens"))
    failed = [r for r in [*with_reuse, *without] if r.status != 200]
    print()
    print(report(with_reuse, without, BANDS))
    differ = sum(
        a.answer != b.answer
        for a, b in zip(with_reuse_sorted(with_reuse), with_reuse_sorted(without), strict=True)
    )
    print(
        "\ncontext: prompt tokens of the turn; off: the same router with --reuse false; pulled: turns whose\n"
        "prefill pulled the previous turn's KV from D (a conversation's first turn has nothing to pull);\n"
        "differ: answers not identical to the no-reuse run's. TTFT includes waiting behind the other\n"
        "client's prompts at the engine (one prefill at a time), which reuse shortens too."
    )
    print(
        f"{len(with_reuse)} turns each way, {len(failed)} failed requests, {differ} answers "
        f"differing from the no-reuse run, {stale} stale reads of D's blocks, "
        f"{p_pulled:,} tokens pulled by P; "
        f"{time.perf_counter() - started:.0f}s in all"
    )
    return 1 if failed or differ or stale else 0


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """`make demo`'s workload flags: --conversations, --turns, --clients, --seed."""
    p.add_argument("--conversations", type=int, default=8, help="agent conversations")
    p.add_argument("--turns", type=int, default=10, help="turns of each")
    p.add_argument("--clients", type=int, default=2, help="conversations run at a time")
    p.add_argument("--seed", type=int, default=1, help="the conversations' seed")


def with_reuse_sorted(records: list[TurnRecord]) -> list[TurnRecord]:
    return sorted(records, key=lambda r: (r.cid, r.turn))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    add_workload_arguments(p)
    args = p.parse_args(argv)
    logs.configure("warning")
    return run_main(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())

"""Real vLLM TTFT: reuse off, through kvferry, and through the multi-turn proxy stand-in.

Real engines (vLLM's CPU build with the NixlConnector, bidirectional, one P and one D,
`realvllm`) serve a random-weight Llama made here, big enough that prefill dominates on
a CPU (``--hidden 512 --layers 8`` by default: ~26M parameters, float32). For each
context size, conversations of two turns go through three front doors in turn, in the
same run, on the same engines:

- **off**: kvferry's router with reuse off (P recomputes the whole history);
- **kvferry**: kvferry's router, daemon (embedded etcd) and sidecars;
- **stand-in**: the per-request structure of vLLM's example multi-turn proxy
  (``bench.router_paths.MultiturnProxyStandIn``), straight to the engines.

Turn 1 is a JSON answer (vLLM 0.32 returns D's kv_transfer_params only there: its
streams carry none), turn 2 streams and is measured: seconds to its first token, the
prompt tokens P pulled (P's own ``vllm:prompt_tokens_by_source_total`` delta), and
whether its answer equals the one without reuse (greedy). Medians per path and size.

    python -m bench.real_vllm [--contexts 2000,6000] [--conversations 5]

Needs the real-vLLM venv: ``make test-vllm`` builds it; this finds it the same way
(``KVFERRY_VLLM_PYTHON``, else the Makefile's path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.daemon_workload import DaemonProcess
from bench.demo import router_settings, wait_nodes
from bench.router_paths import CHAT, MultiturnProxyStandIn, first_token
from kvferry import logs
from kvferry.tasks import run_main
from realvllm.engine import EngineSpec, VllmEngine
from realvllm.metrics import scrape
from realvllm.model import ModelSpec
from router import Router
from sidecar import Settings as SidecarSettings
from sidecar import Sidecar
from sidecar.settings import DaemonSettings as SidecarDaemonSettings
from sidecar.settings import EngineSettings, KvEventSettings, TapSettings

REPO = Path(__file__).resolve().parents[1]
MODEL = "kvferry/bench"
PATHS = ("off", "kvferry", "stand-in")


def vllm_python() -> Path:
    """The real-vLLM venv's python: KVFERRY_VLLM_PYTHON, else where `make test-vllm` puts it."""
    given = os.environ.get("KVFERRY_VLLM_PYTHON")
    if given:
        return Path(given)
    key = subprocess.run(
        ["sha256sum", str(REPO / "realvllm" / "install.sh")], capture_output=True, text=True, check=True
    ).stdout[:12]
    python = Path.home() / ".cache" / "kvferry" / f"vllm-{key}" / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"no real-vLLM venv at {python}: run `make test-vllm` (or realvllm/install.sh) first"
        )
    return python


def make_model(python: Path, spec: ModelSpec) -> Path:
    out = Path.home() / ".cache" / "kvferry" / "models" / spec.key()
    subprocess.run(
        [str(python), "-m", "realvllm.model", str(out), *spec.flags()],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return out


@dataclass
class Turn:
    ttft_s: float
    pulled: float
    answer: str


@dataclass
class Engines:
    prefill: VllmEngine
    decode: VllmEngine

    def stop(self) -> None:
        for engine in (self.decode, self.prefill):
            engine.stop()


def start_engines(python: Path, model: Path, logs_dir: Path, max_len: int) -> Engines:
    common = {"model_dir": model, "served_name": MODEL, "max_model_len": max_len}
    p = VllmEngine(EngineSpec(role="prefill", kv_events=False, **common), python, logs_dir)  # type: ignore[arg-type]
    d = VllmEngine(EngineSpec(role="decode", **common), python, logs_dir)  # type: ignore[arg-type]
    engines = Engines(p, d)
    try:
        for e in (p, d):
            e.start()
        for e in (p, d):
            print(f"{e.name} ready after {e.ready():.0f} s")
    except BaseException:
        engines.stop()
        raise
    return engines


def sidecar_settings(engine: VllmEngine, daemon: str, role: str) -> SidecarSettings:
    return SidecarSettings(
        engine=EngineSettings(
            url=engine.http_url,
            engine_id=f"{role}-bench",
            role=role,
            side_channel_host=engine.side_channel_host,
            side_channel_port=engine.side_channel_port,
            health_interval_s=1.0,
            health_timeout_s=5.0,
        ),
        kv_events=KvEventSettings(
            endpoint=engine.kv_events_endpoint,
            replay_endpoint=engine.kv_events_replay_endpoint,
            topic=engine.spec.kv_events_topic,
        ),
        daemon=SidecarDaemonSettings(addresses=(daemon,)),
        tap=TapSettings(listen="127.0.0.1:0"),
    )


@dataclass
class Doors:
    off: str
    kvferry: str
    stand_in: str
    registered: Any

    def url(self, path: str) -> str:
        return {"off": self.off, "kvferry": self.kvferry, "stand-in": self.stand_in}[path]


@contextlib.asynccontextmanager
async def front_doors(engines: Engines, tmp: Path) -> AsyncIterator[Doors]:
    async with contextlib.AsyncExitStack() as stack:
        daemon = DaemonProcess(tmp / "etcd")
        stack.push_async_callback(daemon.stop)
        await daemon.start()
        d_sidecar = None
        for engine, role in ((engines.prefill, "prefill"), (engines.decode, "decode")):
            sc = await stack.enter_async_context(Sidecar(sidecar_settings(engine, daemon.address, role)))
            d_sidecar = sc if role == "decode" else d_sidecar
        await wait_nodes(daemon.address, 2)
        kvferry = await stack.enter_async_context(Router(router_settings(daemon.address)))
        plain = await stack.enter_async_context(Router(router_settings(daemon.address, reuse=False)))
        stand_in = MultiturnProxyStandIn(engines.prefill.http_url, engines.decode.http_url)
        await stand_in.start()
        stack.push_async_callback(stand_in.stop)
        assert d_sidecar is not None and d_sidecar.retentions is not None
        yield Doors(plain.url, kvferry.url, stand_in.url, d_sidecar.retentions)


_WORDS = "the file read line cache block token tool call result decode prefill agent turn"


def history(n: int, tokens: int) -> list[dict[str, str]]:
    """A first turn of about `tokens` tokens, its own from the first words on."""
    words = _WORDS.split()
    text = " ".join(words[(i * 7 + n) % len(words)] for i in range(tokens))
    return [
        {"role": "system", "content": f"Conversation {n}. You are a careful assistant."},
        {"role": "user", "content": text},
    ]


async def one_conversation(
    http: aiohttp.ClientSession, engines: Engines, doors: Doors, path: str, n: int, tokens: int
) -> Turn:
    url = doors.url(path)
    conversation = f"bench-{path}-{tokens}-{n}-{time.monotonic_ns()}"
    messages = history(n, tokens)
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "conversation_id": conversation}
    async with http.post(url + CHAT, json={**body, "messages": messages, "max_tokens": 32}) as r:
        assert r.status == 200, await r.text()
        answer = (await r.json())["choices"][0]["message"]["content"]
    if path == "kvferry":
        await doors.registered.wait_idle(30)
    messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    before = (await scrape(http, engines.prefill.http_url)).pulled_tokens
    t0 = time.perf_counter()
    second = {**body, "messages": messages, "max_tokens": 8, "stream": True}
    async with http.post(url + CHAT, json=second) as r:
        assert r.status == 200, await r.text()
        ttft, _, text = await first_token(r, t0)
    pulled = (await scrape(http, engines.prefill.http_url)).pulled_tokens - before
    return Turn(ttft, pulled, text)


async def measure(
    engines: Engines, doors: Doors, contexts: Sequence[int], conversations: int
) -> dict[tuple[str, int], list[Turn]]:
    out: dict[tuple[str, int], list[Turn]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        for tokens in contexts:
            for n in range(conversations):
                order = PATHS[n % 3 :] + PATHS[: n % 3]  # (each path goes first as often)
                for path in order:
                    turn = await one_conversation(http, engines, doors, path, n, tokens)
                    out.setdefault((path, tokens), []).append(turn)
                    ms = turn.ttft_s * 1000
                    print(f"  {tokens:>6} tokens  {path:<8} ttft {ms:8.0f} ms  pulled {turn.pulled:.0f}")
    return out


def report(results: dict[tuple[str, int], list[Turn]], contexts: Sequence[int]) -> None:
    print("\nturn 2 TTFT, median over conversations (ms); speedup over reuse off; tokens P pulled")
    head = f"{'kvferry':>8} {'x':>6} {'pulled':>7} | {'stand-in':>8} {'x':>6} {'pulled':>7}"
    print(f"{'context':>8} | {'off':>8} | {head}")
    for tokens in contexts:
        med = {p: statistics.median(t.ttft_s for t in results[(p, tokens)]) for p in PATHS}
        pulled = {p: statistics.median(t.pulled for t in results[(p, tokens)]) for p in PATHS}
        same = {
            p: sum(
                a.answer == b.answer
                for a, b in zip(results[(p, tokens)], results[("off", tokens)], strict=True)
            )
            for p in PATHS
        }
        print(
            f"{tokens:>8} | {med['off'] * 1000:8.0f} | {med['kvferry'] * 1000:8.0f} "
            f"{med['off'] / med['kvferry']:5.2f}x {pulled['kvferry']:7.0f} | {med['stand-in'] * 1000:8.0f} "
            f"{med['off'] / med['stand-in']:5.2f}x {pulled['stand-in']:7.0f}"
        )
        n = len(results[("off", tokens)])
        print(f"{'':>8}   answers equal to reuse off: kvferry {same['kvferry']}/{n}, ", end="")
        print(f"stand-in {same['stand-in']}/{n}")


async def main_async(args: argparse.Namespace) -> int:
    python = vllm_python()
    heads = args.hidden // 64
    spec = ModelSpec(args.hidden, args.layers, heads, heads, args.hidden * 11 // 4, max_len=16384)
    model = make_model(python, spec)
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvferry-real-vllm-") as tmp:
        engines = await asyncio.to_thread(start_engines, python, model, Path(tmp) / "logs", spec.max_len)
        try:
            async with front_doors(engines, Path(tmp)) as doors:
                results = await measure(engines, doors, contexts, args.conversations)
        finally:
            await asyncio.to_thread(engines.stop)
    print(f"\nmodel: {spec}")
    report(results, contexts)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2000,6000", help="first-turn sizes in tokens, comma-separated")
    p.add_argument("--conversations", type=int, default=5, help="conversations per path and size")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
    logs.configure("warning")
    return run_main(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())

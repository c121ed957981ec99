"""Section 1 of the router benchmark (bench.router): what the router adds to a turn's
TTFT against the client's own P-then-D sequence and the multi-turn proxy stand-in, the
reuse path's own work, and answers after an edited history."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from bench.demo import Deployment, deployment, pct
from bench.router_paths import (
    CHAT,
    FRESH,
    STAGES,
    MultiturnProxyStandIn,
    filler,
    first_token,
    stage_totals,
    stream_text,
)


async def direct(http: aiohttp.ClientSession, p_url: str, d_url: str, body: dict[str, Any]) -> float:
    """The P-then-D sequence, issued by the client itself."""
    t0 = time.perf_counter()
    prefill = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": FRESH}
    async with http.post(p_url + CHAT, json=prefill) as r:
        assert r.status == 200, await r.text()
        params = (await r.json())["kv_transfer_params"]
    async with http.post(d_url + CHAT, json={**body, "kv_transfer_params": params}) as r:
        assert r.status == 200, await r.text()
        return (await first_token(r, t0))[0]


async def through(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """The turn through a front door (a router, the stand-in). -> seconds to its first token."""
    t0 = time.perf_counter()
    async with http.post(url + CHAT, json=body) as r:
        assert r.status == 200, await r.text()
        return (await first_token(r, t0))[0]


def _stage_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean ms of each stage between two `stage_totals`."""
    out = {}
    for stage in STAGES:
        seconds, count = (a - b for a, b in zip(after[stage], before[stage], strict=True))
        out[stage] = seconds / count * 1e3 if count else float("nan")
    return out


async def overhead(requests: int, prompt_tokens: int) -> None:
    """Section 1: TTFT per path, the reuse path's stages, edited histories; print them."""
    # D pins every answer's blocks for the next turn (vLLM's bidirectional mode): a short pin
    # and a large pool, so that thousands of one-off requests never run D out of blocks.
    async with deployment(None, {"num_blocks": 65536, "decoder_kv_blocks_ttl": 10.0}) as dep:
        proxy = MultiturnProxyStandIn(dep.prefill.http_url, dep.sidecars[1].url)
        await proxy.start()
        rng = random.Random(3)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                times = await _ttft_per_path(http, dep, proxy, rng, requests, prompt_tokens)
                stages = await _reuse_path_stages(http, dep, rng, prompt_tokens)
                wrong = await edited_history(http, dep, proxy, rng)
        finally:
            await proxy.stop()
    _print_overhead(times, stages, wrong, requests, prompt_tokens)


async def _ttft_per_path(
    http: aiohttp.ClientSession,
    dep: Deployment,
    proxy: MultiturnProxyStandIn,
    rng: random.Random,
    requests: int,
    prompt_tokens: int,
) -> dict[str, list[float]]:
    """TTFT in ms of `requests` turns on each path, interleaved in a random order, after
    20 of warm-up."""
    p_url = dep.prefill.http_url  # as the router sends it (P's sidecar advertises it)
    d_url = dep.sidecars[1].url
    # (name, the path, whether the request names a conversation: a first turn,
    # nothing held for it, so the turn is the control plane's full work with
    # nothing to pull: tokenize, digests, lookup, and D's sidecar capturing)
    paths: dict[str, tuple[Callable[[dict[str, Any]], Awaitable[float]], bool]] = {
        "direct P then D": (lambda b: direct(http, p_url, d_url, b), False),
        "kvferry router": (lambda b: through(http, dep.plain.url, b), False),
        "multi-turn proxy stand-in": (lambda b: through(http, proxy.url, b), False),
        "kvferry, conversation turn": (lambda b: through(http, dep.kvferry.url, b), True),
        "stand-in, conversation turn": (lambda b: through(http, proxy.url, b), True),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(requests + 20):
        body = {
            "messages": [{"role": "user", "content": filler(rng, prompt_tokens)}],
            "max_tokens": 8,
            "stream": True,
        }
        order = list(paths)
        rng.shuffle(order)
        for name in order:
            path, named = paths[name]
            t = await path({**body, "conversation_id": f"{name}-{i}"} if named else body)
            if i >= 20:  # warm-up
                times[name].append(t * 1e3)
    return times


async def _reuse_path_stages(
    http: aiohttp.ClientSession, dep: Deployment, rng: random.Random, prompt_tokens: int
) -> dict[str, float]:
    """The reuse path's own work, on 40 conversation turns through the kvferry router:
    mean ms of each stage."""
    stages_before = stage_totals(dep.kvferry)
    messages = [{"role": "user", "content": filler(rng, prompt_tokens)}]
    for turn in range(40):
        body = {"messages": messages, "max_tokens": 8, "stream": True, "conversation_id": "c"}
        async with http.post(dep.kvferry.url + CHAT, json=body) as r:
            text = await stream_text(r)
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"{turn}"},
        ]
        await asyncio.sleep(0.02)
    return _stage_means(stages_before, stage_totals(dep.kvferry))


def _print_overhead(
    times: dict[str, list[float]],
    stages: dict[str, float],
    wrong: dict[str, int],
    requests: int,
    prompt_tokens: int,
) -> None:
    base = times["direct P then D"]
    print(f"\n1. Router overhead: TTFT, {requests} requests per path, ~{prompt_tokens}-token prompts")
    print(f"   {'path':<28} {'p50':>8} {'p90':>8} {'p99':>8} {'+p50 vs direct':>15}")
    for name, xs in times.items():
        print(
            f"   {name:<28} {pct(xs, 50):>6.2f}ms {pct(xs, 90):>6.2f}ms {pct(xs, 99):>6.2f}ms "
            f"{pct(xs, 50) - pct(base, 50):>+13.2f}ms"
        )
    print(
        "   (the first three: no conversation id, plain P/D; a conversation turn: a first turn, so\n"
        "   kvferry tokenizes, digests and looks up (nothing held) and D's sidecar captures the answer)"
    )
    print(
        f"   edited history (the client drops half of the previous answer), {EDITED} conversations: "
        f"wrong answers: kvferry {wrong['kvferry']}, multi-turn proxy stand-in {wrong['stand-in']}"
    )
    print(
        f"   reuse path (40 conversation turns, ~{prompt_tokens}-token prompts growing), the router's own "
        f"work, mean: tokenize {stages['tokenize']:.2f}ms, digests {stages['digests']:.2f}ms, "
        f"the lookup's wait after them {stages['lookup']:.2f}ms"
    )


EDITED = 10
"""Conversations in the edited-history check."""


async def edited_history(
    http: aiohttp.ClientSession, dep: Deployment, proxy: MultiturnProxyStandIn, rng: random.Random
) -> dict[str, int]:
    """Turn 2 after the client cut the previous answer short: how many answers differ from
    the no-reuse answer, through kvferry and through the stand-in."""
    wrong = {"kvferry": 0, "stand-in": 0}
    urls = {"kvferry": dep.kvferry.url, "stand-in": proxy.url}
    for i in range(EDITED):
        messages = [{"role": "user", "content": filler(rng, 2000)}]
        turn1 = {"messages": messages, "max_tokens": 40, "ignore_eos": True, "stream": True}
        answers = {}
        for name, url in urls.items():
            async with http.post(url + CHAT, json={**turn1, "conversation_id": f"edit-{name}-{i}"}) as r:
                answers[name] = await stream_text(r)
        await asyncio.sleep(0.05)  # D's sidecar registers kvferry's turn
        answer = answers["kvferry"]
        turn2 = [
            *messages,
            {"role": "assistant", "content": answer[: len(answer) // 2]},
            {"role": "user", "content": "And?"},
        ]
        async with http.post(dep.plain.url + CHAT, json={**turn1, "messages": turn2}) as r:
            truth = await stream_text(r)
        for name, url in urls.items():
            body = {**turn1, "messages": turn2, "conversation_id": f"edit-{name}-{i}"}
            async with http.post(url + CHAT, json=body) as r:
                wrong[name] += await stream_text(r) != truth
    return wrong

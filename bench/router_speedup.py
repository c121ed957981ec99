"""Section 2 of the router benchmark (bench.router): the emulated TTFT speedup of turn 2
at long contexts, through kvferry, the multi-turn proxy stand-in and the client alone,
against reuse off and against the timing model's ideal. kvferry is given the engines'
tokenizer files (as `emulator.tokenizer_files` writes them) and tokenizes itself;
"kvferry /tokenize" is the same router without them, asking P's /tokenize. Every front
door (the routers, reuse off's too, and the stand-in) runs in a process of its own
(`bench.parts`), as a deployment runs it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import msgspec

from bench import parts
from bench.demo import TIMING, Deployment, deployment, timing_text
from bench.router_paths import CHAT, FRESH, JSON, STAGES, filler, first_token, stage_seconds
from emulator.tokenizer_files import write_tokenizer_files
from kvferry.v1 import leases_pb2, leases_pb2_grpc
from router.decisions import decode_body, prefill_body
from router.upstream import encode, tokenize_request, tokens_of


@dataclass
class Sample:
    ttft_s: float
    prompt: int
    model_ms: float
    reused: int
    answer: str
    router_ms: float = 0.0
    """The router's own reuse work on this turn's critical path: tokenize, digests, then the
    wait for the lookup's answer once the prompt is known (the rest of its round trip)."""
    stage_ms: dict[str, float] = field(default_factory=dict)
    """`router_ms` by stage (`bench.router_paths.STAGES`)."""


Sent = tuple[float, int, str, int]
"""A turn as the client saw it: seconds to the first token, prompt tokens, the answer, and
the tokens the front door said it reused."""


async def through_front_door(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sent:
    t0 = time.perf_counter()
    async with http.post(url + CHAT, json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200, await r.text()
        reused = int(r.headers.get("X-Kvferry-Reused-Tokens", "0"))
        ttft, prompt, answer = await first_token(r, t0)
    return ttft, prompt, answer, reused


class ClientDirect:
    """Reuse with no front door: the client keeps D's last ``kv_transfer_params`` per
    conversation and sends P, then D's sidecar, the bodies the router sends with
    --forward-prompt-token-ids (the prompt's token ids, which the emulator takes as vLLM
    0.32 does, from its own tokenizer: P's /tokenize, before the turn's clock starts). The
    fewest hops and the least work any reuse of a turn can take on these engines, so its
    share of the ideal speedup is the most that any router (or proxy) could reach here."""

    def __init__(self, http: aiohttp.ClientSession, p_url: str, d_url: str) -> None:
        self.http, self.p_url, self.d_url = http, p_url, d_url
        self.held: dict[str, dict[str, Any]] = {}

    async def turn(self, conversation: str, body: dict[str, Any]) -> Sent:
        req = tokenize_request(CHAT, body)
        async with self.http.post(self.p_url + "/tokenize", json=req) as r:
            ids = tokens_of(await r.read())
        assert ids is not None
        t0 = time.perf_counter()
        kv = {**self.held.pop(conversation, {}), **FRESH, "prompt_token_ids": ids}
        # (encoded as the router encodes them: the stdlib's json takes ms on 64k token ids)
        p_body = encode(prefill_body(body, kv))
        async with self.http.post(self.p_url + CHAT, data=p_body, headers=JSON) as r:
            assert r.status == 200, await r.text()
            params = msgspec.json.decode(await r.read())["kv_transfer_params"]
        decode = encode(decode_body({**body, "stream_options": {"include_usage": True}}, params, ids))

        def hold(event: dict[str, Any]) -> None:
            if event.get("kv_transfer_params"):
                self.held[conversation] = event["kv_transfer_params"]

        async with self.http.post(self.d_url + CHAT, data=decode, headers=JSON) as r:
            assert r.status == 200, await r.text()
            ttft, prompt, answer = await first_token(r, t0, hold)
        return ttft, prompt, answer, 0


Stages = Callable[[], Awaitable[dict[str, float]]]
"""Seconds each reuse stage took so far in the router a turn goes through (`stage_seconds`)."""


async def measured_turn(dep: Deployment, send: Awaitable[Sent], stages_of: Stages | None = None) -> Sample:
    """One streamed turn, sent by ``send``; its TTFT and the timing model's cost of what the
    engines did for it (and the router's stages, read by `stages_of`, when it went through one)."""
    p, d = dep.prefill, dep.decode

    def engine_counts() -> list[float]:
        return [
            p.engine.metrics.total("kvferry_emulator:kv_pulled_tokens"),
            p.engine.metrics.total("kvferry_emulator:kv_pulled_blocks"),
            d.engine.metrics.total("kvferry_emulator:kv_pulled_tokens"),
            d.engine.metrics.total("kvferry_emulator:kv_pulled_blocks"),
            d.engine.metrics.total("vllm:prefix_cache_hits"),
        ]

    before, stages = engine_counts(), await stages_of() if stages_of is not None else {}
    ttft, prompt, answer, reused = await send
    p_tokens, p_blocks, d_tokens, d_blocks, d_hits = (
        a - b for a, b in zip(engine_counts(), before, strict=True)
    )
    p_computed = prompt - p_tokens
    d_computed = max(prompt - d_tokens - d_hits, 1)
    model_ms = TIMING["prefill_ms_per_token"] * (p_computed + d_computed) + TIMING[
        "transfer_ms_per_block"
    ] * (p_blocks + d_blocks)
    after = await stages_of() if stages_of is not None else {}
    stage_ms = {stage: (after[stage] - stages[stage]) * 1e3 for stage in after}
    return Sample(ttft, prompt, model_ms, reused, answer, sum(stage_ms.values()), stage_ms)


PEEK = leases_pb2.LookupRequest(conversation_id="bench-probe", prompt_tokens=1, peek=True)
"""A Lookup that touches the daemon and etcd and claims nothing."""


async def idle_cost(daemon: leases_pb2_grpc.LeasesAsyncStub) -> tuple[float, float]:
    """Median ms of a peek Lookup to the daemon back to back, and after 200 ms idle.

    Each measured turn finds the daemon and etcd idle (the other paths ran meanwhile):
    on this VM a process's first gRPC call after ~200 ms idle costs several ms more
    CPU than the next (no page faults; caches and TLBs refilled), and the turn pays
    it in the router, the daemon and etcd."""
    await daemon.Lookup(PEEK)
    out = []
    for gap in (0.0, 0.2):
        xs = []
        for _ in range(15):
            await asyncio.sleep(gap)
            t0 = time.perf_counter()
            await daemon.Lookup(PEEK)
            xs.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(xs))
    return out[0], out[1]


Paths = dict[str, Callable[[str, dict[str, Any]], Awaitable[Sent]]]
"""How a turn is sent, by name: (conversation id, body) -> the turn as the client saw it."""
KVFERRY = ("kvferry", "kvferry /tokenize")
"""kvferry's paths: given the model's tokenizer files (as the emulator writes them), and
tokenizing through P's /tokenize (no files)."""


@contextlib.asynccontextmanager
async def front_doors(dep: Deployment) -> AsyncIterator[dict[str, str]]:
    """Each front door in its own process (`bench.parts`) -> its URL, by path: kvferry given
    the engines' tokenizer files, kvferry tokenizing through P's /tokenize, reuse off, and
    the multi-turn proxy stand-in."""
    config = dep.prefill.engine.config
    at = ("--daemon", dep.daemon.address, "--daemon-stream", dep.daemon.stream_address)
    with tempfile.TemporaryDirectory(prefix="kvferry-tokenizer-") as tmp:
        files = write_tokenizer_files(Path(tmp), config.model, config.max_model_len)
        doors = {
            "kvferry": ("router", *at, "--tokenizer", str(files)),
            "kvferry /tokenize": ("router", *at),
            "off": ("router", *at, "--reuse", "false"),
            "stand-in": ("stand-in", "--prefill", dep.prefill.http_url, "--decode", dep.sidecars[1].url),
        }
        async with contextlib.AsyncExitStack() as stack:
            urls = {}
            for name, args in doors.items():
                urls[name] = (await stack.enter_async_context(parts.started(*args))).url
            yield urls


MORE_AT_SHORT = 3
"""At most this many times `repeats` conversations at a context length shorter than the
longest (as many times as it is shorter): a short turn is cheap to measure and its ratio
swings most, since the same few milliseconds of noise are a larger share of it."""


def conversations_at(length: int, lengths: Sequence[int], repeats: int) -> int:
    """How many conversations `speedup` measures at `length` (see MORE_AT_SHORT)."""
    return repeats * max(1, min(MORE_AT_SHORT, max(lengths) // length))


async def speedup(lengths: Sequence[int], repeats: int) -> None:
    """Section 2: `repeats` two-turn conversations per context length (more at the shorter
    ones: `conversations_at`), turn 2 measured on every path in a random order; print the
    table."""
    d_blocks = sum(n * conversations_at(n, lengths, repeats) for n in lengths) * 6 // 16 + 16384
    rows = []
    async with (
        deployment(
            {**TIMING, "num_blocks": 2 * max(lengths) // 16 + 4096},
            {**TIMING, "num_blocks": d_blocks, "decoder_kv_blocks_ttl": 600.0},
        ) as dep,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
        front_doors(dep) as doors,
    ):
        direct = ClientDirect(http, dep.prefill.http_url, dep.sidecars[1].url)
        rng = random.Random(5)
        probe = grpc.aio.insecure_channel(dep.daemon.address)
        daemon = leases_pb2_grpc.LeasesStub(probe)
        paths: Paths = {name: _through(http, url) for name, url in doors.items()}
        paths["no router"] = direct.turn
        stages: dict[str, Stages] = {
            name: functools.partial(stage_seconds, http, doors[name]) for name in KVFERRY
        }
        try:
            for length in lengths:
                runs: dict[str, list[Sample]] = {name: [] for name in paths}
                for i in range(conversations_at(length, lengths, repeats)):
                    await _conversation(dep, paths, runs, rng, length, i, stages)
                rows.append(runs)
            warm_ms, cold_ms = await idle_cost(daemon)
        finally:
            await probe.close(None)
    _print_speedup(rows, warm_ms, cold_ms)


def _through(http: aiohttp.ClientSession, url: str) -> Callable[[str, dict[str, Any]], Awaitable[Sent]]:
    """A path through the front door at `url`: the turn's body with its conversation id."""
    return lambda cid, body: through_front_door(http, url, {**body, "conversation_id": cid})


async def _conversation(
    dep: Deployment,
    paths: Paths,
    runs: dict[str, list[Sample]],
    rng: random.Random,
    length: int,
    i: int,
    stages: dict[str, Stages],
) -> None:
    """Conversation `i` of `length` characters on every path: turn 1 leaves D's blocks,
    turn 2 is measured, a Sample added to `runs` for each path (with the router's stages,
    read by `stages[path]`, for kvferry's paths)."""
    messages = [
        {"role": "system", "content": filler(rng, length - 600)},
        {"role": "user", "content": f"Question {i}: " + filler(rng, 200)},
    ]
    turn1 = {"messages": messages, "max_tokens": 16, "stream": True}
    answers = set()
    for name in (*KVFERRY, "stand-in", "no router"):  # turn 1, leaving D's blocks
        answers.add((await paths[name](f"{name}-{length}-{i}", turn1))[2])
    assert len(answers) == 1, answers  # (reuse's correctness is section 3's business)
    await asyncio.sleep(0.1)  # D's sidecar registers kvferry's turn
    tool = {"role": "tool", "content": filler(rng, 400)}
    turn2 = {
        **turn1,
        "messages": [*messages, {"role": "assistant", "content": answers.pop()}, tool],
    }
    order = list(paths)
    rng.shuffle(order)  # none always meets a warmer engine
    for name in order:
        send = paths[name](f"{name}-{length}-{i}", turn2)
        runs[name].append(await measured_turn(dep, send, stages.get(name)))
    assert len({runs[n][-1].answer for n in paths}) == 1, "answers differ"


def _p50(xs: list[Sample], key: Callable[[Sample], float]) -> float:
    return statistics.median(key(x) for x in xs)


def _print_speedup(rows: list[dict[str, list[Sample]]], warm_ms: float, cold_ms: float) -> None:
    counts = "/".join(str(len(runs["kvferry"])) for runs in rows)
    print(f"\n2. Emulated TTFT speedup, turn 2 vs reuse off ({timing_text()}), {counts} conversations")
    print(
        f"   {'context':>8} {'reused':>6} | {'TTFT off':>8} {'kvferry':>8} {'speedup':>7} | "
        f"{'model off':>9} {'model on':>8} {'ideal':>6} | {'of ideal':>8} | {'router':>6} | "
        f"{'stand-in':>8} {'of ideal':>8} | {'no router':>9} {'of ideal':>8}"
    )
    for runs in rows:
        print(_speedup_row(runs))
    print("   kvferry over the stand-in (p50 TTFT), and the router's stages (p50 ms of its turns):")
    for name in KVFERRY:
        for runs in rows:
            print(_overhead_row(runs, name))
    print(
        "   model = the timing model's cost of the tokens the engines computed and the blocks they moved;\n"
        "   ideal = model off / the least model cost of a correct reuse of the turn (kvferry's, the\n"
        "   stand-in's or the client's, whichever pulled most);\n"
        "   router = tokenize + digests + the lookup's remaining wait (its claim overlaps tokenizing),\n"
        "   the work kvferry adds to verify and claim a reuse;\n"
        "   stand-in = the multi-turn proxy's reuse (D's last params, unverified) on the same engines;\n"
        "   no router = the client sends P (with D's last params) and then D's sidecar itself: the\n"
        "   fewest hops any reuse takes here, so its share of the ideal is the most a router could reach."
    )
    print(
        f"   a daemon Lookup (peek) here: {warm_ms:.2f} ms back to back, {cold_ms:.2f} ms after 200 ms"
        "\n   idle, which is how each measured turn finds the router's gRPC client, the daemon and etcd."
    )


def _overhead_row(runs: dict[str, list[Sample]], name: str) -> str:
    """One context length's cost of verifying: kvferry's TTFT (path `name`) over the
    stand-in's, by stage."""
    on = runs[name]
    t_on, t_in = (_p50(runs[n], lambda x: x.ttft_s * 1e3) for n in (name, "stand-in"))
    stages = " ".join(
        f"{stage} {statistics.median(x.stage_ms.get(stage, 0.0) for x in on):.1f}" for stage in STAGES
    )
    ratio = f"{t_on:>6.1f}ms / {t_in:>6.1f}ms = {t_on / t_in - 1:>+6.1%}"
    return f"   {name:>17} {on[0].prompt:>7,} {ratio} | {stages}"


def _speedup_row(runs: dict[str, list[Sample]]) -> str:
    """One context length's row: medians per path, the ideal, and each path's share of it."""
    on, off = runs["kvferry"], runs["off"]
    t_off, m_off = _p50(off, lambda x: x.ttft_s * 1e3), _p50(off, lambda x: x.model_ms)
    # What the model allows: the least work any correct reuse of this turn needed (the
    # stand-in and the client pull all D's params name; the answers matched, so their
    # pulls were valid).
    m_best = min(_p50(runs[n], lambda x: x.model_ms) for n in ("kvferry", "stand-in", "no router"))
    ideal = m_off / m_best
    t = {n: _p50(runs[n], lambda x: x.ttft_s * 1e3) for n in ("kvferry", "stand-in", "no router")}
    share = {n: t_off / t[n] / ideal for n in t}
    reused = sum(x.reused for x in on) / sum(x.prompt for x in on)
    return (
        f"   {on[0].prompt:>8,} {reused:>6.0%} | {t_off:>6.0f}ms {t['kvferry']:>6.0f}ms "
        f"{t_off / t['kvferry']:>6.2f}x | {m_off:>7.0f}ms {_p50(on, lambda x: x.model_ms):>6.0f}ms "
        f"{ideal:>5.2f}x | {share['kvferry']:>8.0%} | {_p50(on, lambda x: x.router_ms):>4.1f}ms | "
        f"{t['stand-in']:>6.0f}ms {share['stand-in']:>8.0%} | {t['no router']:>7.0f}ms "
        f"{share['no router']:>8.0%}"
    )

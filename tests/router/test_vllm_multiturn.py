"""A workload in the input format of vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py``
runs through the router with that benchmark's conversation-id conventions.

The input file is a ``generate_conversations`` config (``filetype``,
``num_conversations``, ``text_files``, ``prompt_input`` with ``num_turns``,
``prefix_num_tokens``, ``num_tokens``, optional ``common_prefix_num_tokens``,
``prompt_output.num_tokens``; each a distribution) or a list of
``{"id": ..., "messages": [{"role", "content"}, ...]}`` conversations. The
generator below builds conversations the way the benchmark's
``generate_conversations`` does (a per-conversation first-turn prefix from the
text files, user turns of ``num_tokens``, dataset answers only sizing
``max_tokens``), with the emulator's byte tokenizer standing in for the model's.
The client sends what the benchmark sends with ``--send-conversation-id``: the
history with the *actual* previous answers, a body ``conversation_id``, an
``X-Session-ID`` header, ``stream`` with ``stream_options.include_usage: false``.

Every turn streams, so what it reuses depends on D's streams: vLLM 0.32's carry no
``kv_transfer_params``, so D's sidecar registers nothing and every turn is computed
whole (and answered right), and it counts the turns as uncaptured; with vLLM PR 40186 (the emulator's
``stream_kv_transfer_params``) every turn after the first pulls.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.router.conftest import MakeStack, Reference
from tests.router.helpers import CHAT, ask, pulled_tokens

Conversations = dict[str, list[dict[str, str]]]

CONFIG = {
    "filetype": "generate_conversations",
    "num_conversations": 8,
    "text_files": ["corpus.txt"],
    "print_stats": False,
    "prompt_input": {
        "num_turns": {"distribution": "uniform", "min": 6, "max": 8},
        "common_prefix_num_tokens": {"distribution": "constant", "value": 120},
        "prefix_num_tokens": {"distribution": "uniform", "min": 200, "max": 600},
        "num_tokens": {"distribution": "uniform", "min": 40, "max": 80},
    },
    "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 20, "max": 40}},
}
BASE_PROMPT = "Please rewrite the following text and add more content: "


def _sample(conf: dict[str, Any], rng: random.Random) -> int:
    kind = conf["distribution"]
    if kind == "constant":
        return int(conf["value"])
    if kind == "uniform":
        return rng.randint(int(conf["min"]), int(conf["max"]))
    raise ValueError(f"distribution {kind!r} is not needed by this test")


def generate_conversations(conf: dict[str, Any], base: Path, seed: int = 0) -> Conversations:
    """Conversations from a generate_conversations config (byte tokens)."""
    assert conf["filetype"] == "generate_conversations" and conf["num_conversations"] > 0
    rng = random.Random(seed)
    text = "".join((base / name).read_text() for name in conf["text_files"])
    inp, out = conf["prompt_input"], conf["prompt_output"]
    common = _sample(inp["common_prefix_num_tokens"], rng) if "common_prefix_num_tokens" in inp else 0
    offset = common
    conversations: Conversations = {}
    for conv in range(conf["num_conversations"]):
        turns = max(_sample(inp["num_turns"], rng), 2)
        turns += turns % 2
        messages: list[dict[str, str]] = []
        for turn in range(turns):
            if turn % 2:
                messages.append({"role": "assistant", "content": text[: _sample(out["num_tokens"], rng)]})
                continue
            content = f"{conv} is a nice number... "
            if turn == 0:
                content = (text[: common - 2] + "." if common else "") + content
                prefix = _sample(inp["prefix_num_tokens"], rng)
                content += f"{conv}, " + text[offset : offset + prefix]
                offset += prefix
            content += BASE_PROMPT
            left = _sample(inp["num_tokens"], rng) - len(content)
            if left > 0:
                start = offset + turn * 100
                content += text[start : start + left]
            messages.append({"role": "user", "content": content})
        conversations[f"CONV_ID_{conv}"] = messages
        offset += turns
    return conversations


def load_input(path: Path) -> Conversations:
    """Either input format of the benchmark."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        return generate_conversations(data, path.parent)
    return {item["id"]: item["messages"] for item in data}


async def _run_conversation(
    http: aiohttp.ClientSession,
    url: str,
    conv_id: str,
    messages: list[dict[str, str]],
    settle: Callable[[], Awaitable[None]],
) -> list[tuple[dict[str, Any], Any]]:
    """Send every user turn like the benchmark: history with actual answers, its id conventions."""
    history: list[dict[str, str]] = []
    sent: list[tuple[dict[str, Any], Any]] = []
    for i in range(0, len(messages), 2):
        history.append(messages[i])
        body = {
            "model": "kvferry/emulated-model",
            "messages": list(history),
            "conversation_id": conv_id,
            "stream": True,
            "stream_options": {"include_usage": False},
            "max_tokens": len(messages[i + 1]["content"]) if i + 1 < len(messages) else 32,
        }
        res = await ask(http, url, body, {"Content-Type": "application/json", "X-Session-ID": conv_id})
        assert res.status == 200, res.body
        sent.append((body, res))
        history.append({"role": "assistant", "content": res.text})
        await settle()  # the benchmark's clients pace themselves; here: until D's blocks are registered
    return sent


def _benchmark_input(tmp_path: Path) -> Conversations:
    """The conversations CONFIG generates from a corpus of harbour words, read as the
    benchmark reads its input, from both of its formats (written in `tmp_path`)."""
    words = [
        "ferry",
        "harbour",
        "tide",
        "pier",
        "crane",
        "hull",
        "bow",
        "stern",
        "rope",
        "gull",
        "wave",
        "quay",
        "deck",
    ]
    rng = random.Random(7)
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(6000)))
    (tmp_path / "generate_multi_turn.json").write_text(json.dumps(CONFIG))
    conversations = load_input(tmp_path / "generate_multi_turn.json")
    assert len(conversations) == 8 and all(len(m) % 2 == 0 for m in conversations.values())
    (tmp_path / "sharegpt.json").write_text(
        json.dumps([{"id": k, "messages": v} for k, v in conversations.items()])
    )
    assert load_input(tmp_path / "sharegpt.json") == conversations
    return conversations


@pytest.mark.parametrize("streams_params", [False, True], ids=["vllm-0.32", "vllm-pr-40186"])
async def test_vllm_multi_turn_benchmark_input_runs_through_the_router(
    tmp_path: Path,
    make_stack: MakeStack,
    http: aiohttp.ClientSession,
    reference: Reference,
    streams_params: bool,
) -> None:
    conversations = _benchmark_input(tmp_path)
    stack = await make_stack(d_config={"stream_kv_transfer_params": streams_params})
    router = await stack.router()
    [d] = stack.decodes

    async def settle() -> None:
        await stack.registrations_idle(20)  # (8 conversations at once on a busy 2-core machine)

    async with asyncio.TaskGroup() as group:  # (one failing cancels the others: none is left running)
        tasks = [
            group.create_task(_run_conversation(http, router.url, cid, msgs, settle))
            for cid, msgs in conversations.items()
        ]
    runs = [t.result() for t in tasks]
    turns = [t for run in runs for t in run]
    later = [res for run in runs for _, res in run[1:]]
    assert all(run[0][1].reason == "no_lease" for run in runs)
    for body, res in turns:
        assert res.text == await reference(CHAT, body)
    outcomes = {
        outcome: stack.sidecar(d).metrics.registry.get_sample_value(
            "kvferry_sidecar_turns_total", {"outcome": outcome}
        )
        or 0.0
        for outcome in ("captured", "no_params", "stream_without_params")
    }
    if streams_params:  # every turn's answer is retained, and the next turn pulls it
        assert all(res.decision == "PULL" for res in later), [
            (r.decision, r.reason) for r in later if r.decision != "PULL"
        ]
        assert outcomes == {"captured": len(turns), "no_params": 0, "stream_without_params": 0}
        reused = router.metrics.value("kvferry_router_reused_tokens_total")
        assert reused == sum(r.reused for r in later) > 0
    else:  # D's streams name no blocks: nothing is retained, each turn is computed whole
        assert all((r.decision, r.reason) == ("RECOMPUTE", "no_lease") for r in later), [
            (r.decision, r.reason) for r in later
        ]
        # (told apart from answers that pin nothing: D keeps each turn's blocks to its TTL)
        assert outcomes == {"captured": 0, "no_params": 0, "stream_without_params": len(turns)}
        assert router.metrics.value("kvferry_router_reused_tokens_total") == 0
        assert sum(pulled_tokens(p) for p in stack.prefills) == 0

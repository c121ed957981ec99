"""Trace readers: multi-turn traces in three formats, read into one `Workload`. Pure parsing.

A bad trace gets a `TraceError` naming the file and line (or the conversation) and what
is wrong; nothing here opens a network connection or needs a tokenizer.

Formats (what each source documents; checked against the sources named):

- ``vllm``: the input of vLLM's multi-turn benchmark,
  ``benchmarks/multi_turn/benchmark_serving_multi_turn.py --input-file``
  (vllm-project/vllm, ``benchmarks/multi_turn/bench_dataset.py``):

  * a ShareGPT-like JSON list of conversations, ``[{"id": "...", "messages": [{"role":
    "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}]``
    (``conversations_list_to_dict``: ids are strings, unique; messages a non-empty
    list). A turn is a user message and the assistant answer after it: its prompt is
    every message before the answer, its output the answer. Tokens are estimated from
    characters (``chars_per_token``, 4 by default; 1 for kvferry's byte-token emulator).
  * a generation config, ``{"filetype": "generate_conversations", "num_conversations":
    24, "prompt_input": {"num_turns": {...}, "common_prefix_num_tokens": {...},
    "prefix_num_tokens": {...}, "num_tokens": {...}}, "prompt_output": {"num_tokens":
    {...}}}`` (``benchmarks/multi_turn/generate_multi_turn.json``), each ``{...}`` a
    distribution: ``constant`` (value), ``uniform`` (min, max), ``lognormal`` (average,
    max), ``zipf`` and ``poisson`` (alpha, max). ``num_turns`` counts messages (user and
    assistant), as there. Token counts are drawn here with a seeded generator (no text:
    only sizes matter to the planner).

  Neither carries times: turns of a conversation follow each other after ``think_s``,
  ``clients`` conversations at a time. (The benchmark runs ``--num-clients`` clients over
  ``--max-active-conversations`` conversations, a client taking turns of its active
  conversations in turn, with ``--request-rate`` Poisson delays between requests: give
  ``clients`` the active conversations and ``think_s`` the time a conversation waits for
  its client between turns.)

- ``mooncake``: Mooncake's open trace format (kvcache-ai/Mooncake,
  ``FAST25-release/traces``; as NVIDIA's aiperf and dynamo read it): JSONL, one request a
  line, ``{"timestamp": 27482, "input_length": 655, "output_length": 52, "hash_ids":
  [46, 47]}``: arrival in ms since the first request, and the ids of the prompt's blocks
  of ``hash_block_tokens`` (512) tokens: equal ids at the start of two prompts are a
  shared prefix. An optional ``session_id`` (aiperf's multi-turn variant) names the
  conversation; without it, a request continues the conversation of the latest request
  it shares a prefix with, when that request is the conversation's last turn (the one D
  would retain), and starts a new one otherwise.

- ``kvferry``: the router's ``--trace-out`` (`router.trace`): a header line, then one
  finished turn a line, with its measured reuse and TTFT (kept in `Turn.measured`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

FORMATS = ("vllm", "mooncake", "kvferry")
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in Mooncake's published traces."""


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file, the line, and the fault."""


@dataclass(frozen=True)
class Measured:
    """What the router recorded of a turn (kvferry traces only)."""

    decision: str
    reused_tokens: int
    ttft_ms: float | None
    latency_ms: float
    reason: str = ""
    """The decision's reason (traces before it was recorded: "")."""

    @property
    def skipped_for_the_run(self) -> bool:
        """The router did not look the turn up (or got no usable answer) for a reason of the
        run or of the request: the daemon late or unreachable, a prompt it cannot verify.
        A replay skips it too: no retention policy changes that. (Not reuse being off: a
        replay decides that, and not a trace without reasons.)"""
        return self.decision == "SKIPPED" and self.reason not in ("", "reuse_off")


@dataclass(frozen=True)
class Turn:
    """One request of a multi-turn workload, as sizes and times only."""

    conversation: str
    index: int
    """Its position in the conversation (0: the first)."""
    prompt_tokens: int
    output_tokens: int
    shared_tokens: int
    """Tokens at the start of its prompt that the previous turn's context (its prompt and
    output, what D retains) covers: the most a pull can reuse (0 for a first turn)."""
    arrival_s: float | None = None
    """Seconds from the trace's start; None: ``think_s`` after the previous turn's end."""
    measured: Measured | None = None
    think_s: float | None = None
    """Seconds from the previous turn's end to this one's arrival, when the trace says (a
    kvferry trace): the replay keeps it, whenever the previous turn ends there."""


@dataclass(frozen=True)
class Workload:
    """A trace's turns, in arrival order when timed, else conversation by conversation."""

    turns: tuple[Turn, ...]
    source: str
    timed: bool
    """Arrivals come from timestamps (open loop); else turns follow their conversation's
    previous one after the think time (closed loop, `clients` at a time)."""

    @property
    def conversations(self) -> int:
        """How many conversations it has."""
        return len({t.conversation for t in self.turns})


def read_trace(path: Path, fmt: str, chars_per_token: float = 4.0, seed: int = 1) -> Workload:
    """Read `path` as `fmt` (one of `FORMATS`); TraceError when it is not one."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}: one of {', '.join(FORMATS)}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read: {e}") from None
    if fmt == "kvferry":
        return read_kvferry(text, str(path))
    if fmt == "mooncake":
        return read_mooncake(text, str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}:{e.lineno}: not JSON: {e.msg}") from None
    if isinstance(data, dict) and data.get("filetype") == "generate_conversations":
        return generate_vllm(data, str(path), seed)
    return read_vllm(data, str(path), chars_per_token)


# -- vLLM's multi-turn benchmark ------------------------------------------------------------


def read_vllm(data: Any, name: str, chars_per_token: float = 4.0) -> Workload:
    """vLLM's ShareGPT-like conversations (already parsed JSON)."""
    if not isinstance(data, list):
        raise TraceError(f"{name}: expected a JSON list of conversations or a generation config")
    if chars_per_token <= 0:
        raise TraceError("chars_per_token must be positive")
    turns: list[Turn] = []
    seen: set[str] = set()
    for n, conv in enumerate(data):
        where = f"{name}: conversation {n}"
        if not isinstance(conv, dict) or not isinstance(conv.get("id"), str):
            raise TraceError(f"{where}: needs a string 'id'")
        cid = conv["id"]
        if cid in seen:
            raise TraceError(f"{where}: id {cid!r} found more than once")
        seen.add(cid)
        messages = conv.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TraceError(f"{where} ({cid!r}): 'messages' must be a non-empty list")
        sizes = [_message_tokens(m, f"{where} message {i}", chars_per_token) for i, m in enumerate(messages)]
        turns.extend(_conversation_turns(cid, [(m["role"], s) for m, s in zip(messages, sizes, strict=True)]))
    return Workload(tuple(turns), name, timed=False)


def _message_tokens(message: Any, where: str, chars_per_token: float) -> int:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TraceError(f"{where}: needs a string 'role'")
    content = message.get("content")
    if not isinstance(content, str):
        raise TraceError(f"{where}: needs a string 'content'")
    return max(1, math.ceil(len(content) / chars_per_token))


def _conversation_turns(cid: str, messages: list[tuple[str, int]]) -> Iterator[Turn]:
    """Turns of one conversation: each assistant message answers everything before it."""
    context, index, previous = 0, 0, 0
    for role, tokens in messages:
        if role == "assistant" and context:
            yield Turn(cid, index, context, tokens, min(previous, context) if index else 0)
            index += 1
            previous = context + tokens
        context += tokens


def generate_vllm(config: Mapping[str, Any], name: str, seed: int = 1) -> Workload:
    """Conversation sizes drawn from vLLM's ``generate_conversations`` config."""
    rng = random.Random(seed)
    try:
        count = int(config["num_conversations"])
        inputs, outputs = config["prompt_input"], config["prompt_output"]
        dists = {
            "turns": inputs["num_turns"],
            "common": inputs.get("common_prefix_num_tokens", {"distribution": "constant", "value": 0}),
            "prefix": inputs.get("prefix_num_tokens", {"distribution": "constant", "value": 0}),
            "user": inputs["num_tokens"],
            "answer": outputs["num_tokens"],
        }
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{name}: generation config lacks or mistypes {e}") from None
    common = _draw(dists["common"], rng, f"{name}: common_prefix_num_tokens")
    turns: list[Turn] = []
    for c in range(count):
        messages = max(2, _draw(dists["turns"], rng, f"{name}: num_turns"))
        messages += messages % 2  # (the benchmark makes it even: a user message, its answer)
        first = common + _draw(dists["prefix"], rng, f"{name}: prefix_num_tokens")
        sizes: list[tuple[str, int]] = []
        for m in range(messages):
            if m % 2 == 0:
                user = max(1, _draw(dists["user"], rng, f"{name}: prompt_input.num_tokens"))
                sizes.append(("user", user + (first if m == 0 else 0)))
            else:
                sizes.append(("assistant", max(1, _draw(dists["answer"], rng, f"{name}: prompt_output"))))
        turns.extend(_conversation_turns(f"CONV_ID_{c}", sizes))
    return Workload(tuple(turns), name, timed=False)


def _draw(spec: Any, rng: random.Random, where: str) -> int:
    """One draw of a vLLM benchmark distribution."""
    if not isinstance(spec, dict) or not isinstance(spec.get("distribution"), str):
        raise TraceError(f"{where}: a distribution needs a 'distribution' name")
    kind = spec["distribution"]
    try:
        if kind == "constant":
            return int(spec["value"])
        if kind == "uniform":
            return rng.randint(int(spec["min"]), int(spec["max"]))
        if kind == "lognormal":
            average, top = float(spec["average"]), int(spec.get("max", 1 << 30))
            sigma = 1.0
            return min(top, max(1, round(rng.lognormvariate(math.log(average) - sigma**2 / 2, sigma))))
        if kind in ("zipf", "poisson"):
            alpha, top = float(spec["alpha"]), int(spec.get("max", 1 << 30))
            return min(top, _zipf(rng, alpha) if kind == "zipf" else _poisson(rng, alpha))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: {kind} distribution lacks or mistypes {e}") from None
    raise TraceError(f"{where}: unknown distribution {kind!r}")


def _zipf(rng: random.Random, alpha: float) -> int:
    if alpha <= 1:
        raise ValueError("alpha (zipf needs alpha > 1)")
    return max(1, int(rng.paretovariate(alpha - 1)))


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


# -- Mooncake-style timestamped traces ------------------------------------------------------


def _json_lines(text: str, name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{name}:{lineno}: not JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{name}:{lineno}: expected a JSON object")
        yield lineno, obj


def _count(obj: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, not {value!r}")
    return value


def read_mooncake(text: str, name: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Workload:
    """Mooncake-style JSONL: timestamp (ms), input_length, output_length, hash_ids."""
    turns: list[Turn] = []
    owner: dict[int, int] = {}  # hash id -> the latest request holding it
    last_of: dict[str, int] = {}  # conversation -> its latest request
    ids: list[list[int]] = []
    for lineno, obj in _json_lines(text, name):
        where = f"{name}:{lineno}"
        stamp = obj.get("timestamp")
        if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp):
            raise TraceError(f"{where}: 'timestamp' (ms) must be a number, not {stamp!r}")
        prompt = _count(obj, "input_length", where, 1)
        output = _count(obj, "output_length", where)
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        n = len(turns)
        session = obj.get("session_id")
        parent = last_of.get(str(session)) if session is not None else _parent(hashes, owner)
        if parent is not None and session is None and last_of.get(turns[parent].conversation) != parent:
            parent = None  # (it shares a prefix with a turn D no longer retains)
        cid = (
            str(session)
            if session is not None
            else (turns[parent].conversation if parent is not None else f"r{n}")
        )
        shared = 0
        if parent is not None:
            prev = turns[parent]
            common = _common_prefix(ids[parent], hashes)
            shared = min(common * block_tokens, prompt, prev.prompt_tokens + prev.output_tokens)
        index = turns[parent].index + 1 if parent is not None else 0
        turns.append(Turn(cid, index, prompt, output, shared, stamp / 1000.0))
        ids.append(hashes)
        last_of[cid] = n
        for h in hashes:
            owner[h] = n
    turns_sorted = sorted(turns, key=lambda t: t.arrival_s or 0.0)
    return Workload(tuple(turns_sorted), name, timed=True)


def _parent(hashes: list[int], owner: Mapping[int, int]) -> int | None:
    """The latest request holding the longest prefix of `hashes` (None: no shared prefix)."""
    parent = None
    for h in hashes:
        holder = owner.get(h)
        if holder is None or (parent is not None and holder < parent):
            break
        parent = holder
    return parent


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- kvferry's own router trace ---------------------------------------------------------------


def read_kvferry(text: str, name: str) -> Workload:
    """The router's ``--trace-out`` file (`router.trace`)."""
    turns: list[Turn] = []
    previous: dict[str, Turn] = {}
    start: float | None = None
    for lineno, obj in _json_lines(text, name):
        if "kvferry_trace" in obj:
            if obj["kvferry_trace"] != 1:
                raise TraceError(f"{name}:{lineno}: trace version {obj['kvferry_trace']!r}, this reads 1")
            continue
        where = f"{name}:{lineno}"
        t = obj.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise TraceError(f"{where}: 't' must be a number (seconds), not {t!r}")
        start = t if start is None else min(start, t)
        prompt = _count(obj, "prompt_tokens", where)
        output = _count(obj, "output_tokens", where)
        index = _count(obj, "turn", where)
        conversation = obj.get("conversation")
        if not isinstance(conversation, str):
            raise TraceError(f"{where}: 'conversation' must be a string")
        tenant = obj.get("tenant", "")
        cid = f"{tenant}/{conversation}" if conversation else f"line{lineno}"
        ttft = obj.get("ttft_ms")
        reason = obj.get("reason", "")
        if not isinstance(reason, str):
            raise TraceError(f"{where}: 'reason' must be a string, not {reason!r}")
        measured = Measured(
            str(obj.get("decision", "")),
            _count(obj, "reused_tokens", where),
            float(ttft) if isinstance(ttft, (int, float)) else None,
            float(obj.get("latency_ms") or 0.0),
            reason,
        )
        prev = previous.get(cid) if index else None
        shared = min(prompt, prev.prompt_tokens + prev.output_tokens) if prev is not None else 0
        think = None
        if prev is not None and prev.measured is not None and prev.arrival_s is not None:
            think = max(0.0, t - prev.arrival_s - prev.measured.latency_ms / 1e3)
        turn = Turn(cid, index, prompt, output, shared, t, measured, think)
        turns.append(turn)
        previous[cid] = turn
    if start is None:
        raise TraceError(f"{name}: no turns in the trace")
    shifted = [replace(t, arrival_s=(t.arrival_s or 0.0) - start) for t in turns]
    shifted.sort(key=lambda t: t.arrival_s or 0.0)
    return Workload(tuple(shifted), name, timed=True)

"""The router's turn trace (``--trace-out FILE``): one JSON line per finished turn, no content.

What `kvferry plan` replays (`planner.traces.read_kvferry`): when each turn began, whose
and which conversation it was (digests, salted per file: the same id gives the same
digest within one file and nothing a reader could look up), the turn's index in its
conversation, its prompt and output tokens, the tokens it reused, the lookup's
decision and its reason (`router.decisions`: why a turn was SKIPPED, say), and its time
to first byte and latency::

    {"t": 1764650000.123, "tenant": "9f2c...", "conversation": "41ab...", "turn": 3,
     "prompt_tokens": 9120, "output_tokens": 48, "reused_tokens": 6592,
     "decision": "PULL", "reason": "partial_pull", "ttft_ms": 61.2, "latency_ms": 160.4}

Off by default. On, a turn costs one small dict, a digest and a buffered write (the file
is flushed when the router stops, or as its buffer fills). Output tokens come from the
answer's ``usage`` (a stream has it when the client asked for ``include_usage``), else
they are the request's ``max_tokens`` (a bound), else 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import OrderedDict
from typing import IO, Any

VERSION = 1
"""The trace's format version (its first line says so)."""
_MAX_CONVERSATIONS = 100_000
"""Conversations whose turn count is remembered (the least recent forgotten: a turn of one
forgotten restarts at 0, which the planner reads as a new conversation)."""
_USAGE = re.compile(rb'"(prompt_tokens|completion_tokens)"\s*:\s*(\d+)')


class UsageSniffer:
    """The token counts of an answer's ``usage``, found in its bytes as they pass."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        """Look at the next bytes of the answer (a key split across chunks is still found)."""
        data = self._tail + chunk
        if b"_tokens" in data:
            for key, value in _USAGE.findall(data):
                if key == b"prompt_tokens":
                    self.prompt_tokens = int(value)
                else:
                    self.completion_tokens = int(value)
        self._tail = data[-40:]


class TurnTrace:
    """The trace file one router appends finished turns to."""

    def __init__(self, path: str) -> None:
        """Open `path` for appending (OSError when it cannot be)."""
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._salt = os.urandom(16)
        self._turns: OrderedDict[str, int] = OrderedDict()
        self._file.write(json.dumps({"kvferry_trace": VERSION, "salt_per_file": True}) + "\n")

    def digest(self, value: str) -> str:
        """A salted digest of an id ("" stays "")."""
        if not value:
            return ""
        return hashlib.blake2b(value.encode(), digest_size=8, key=self._salt).hexdigest()

    def turn_index(self, conversation: str) -> int:
        """The index of this turn in `conversation` (0 for its first, and without one)."""
        if not conversation:
            return 0
        index = self._turns.pop(conversation, -1) + 1
        self._turns[conversation] = index
        if len(self._turns) > _MAX_CONVERSATIONS:
            self._turns.popitem(last=False)
        return index

    def record(
        self,
        *,
        started: float,
        tenant: str,
        conversation: str,
        prompt_tokens: int,
        output_tokens: int,
        reused_tokens: int,
        decision: str,
        ttft_s: float | None,
        latency_s: float,
        reason: str = "",
    ) -> None:
        """Append one finished turn (`started`: its wall-clock start, seconds)."""
        if self._file is None:
            return
        line: dict[str, Any] = {
            "t": round(started, 4),
            "tenant": self.digest(tenant),
            "conversation": self.digest(conversation),
            "turn": self.turn_index(conversation),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "reused_tokens": reused_tokens,
            "decision": decision,
            "reason": reason,
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1e3, 3),
            "latency_ms": round(latency_s * 1e3, 3),
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Flush and close the file; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None


def check_trace_out(path: str) -> None:
    """ValueError, saying why, when `path` ("" = none) cannot be appended to."""
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"--trace-out {path}: cannot write: {e.strerror or e}") from None


def wall_clock_of(perf_started: float) -> float:
    """The wall-clock time of a `time.perf_counter()` reading taken earlier."""
    return time.time() - (time.perf_counter() - perf_started)

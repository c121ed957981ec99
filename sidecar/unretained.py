"""Blocks D pins that no retention names: the streamed turns the sidecar cannot capture.

A decode engine with bidirectional transfer (vLLM's NixlConnector) pins all the
blocks of a request that came with a prefill's params (``do_remote_prefill``) and
finished normally (stopped or length-capped) for ``decoder_kv_blocks_ttl`` (480 s by
default), and describes them in the answer's ``kv_transfer_params``. vLLM 0.32 puts
those in non-streamed answers only (streams carry them with vLLM PR 40186, open).
Without them the sidecar knows neither D's request id nor its block ids: no
retention is registered (the next turn recomputes its history) and nothing can free
the blocks before D's TTL. This module tells such a turn apart (`outcome_of`), counts
the blocks it pins (`computed_tokens`, `pinned_blocks`) and keeps them in a ledger
until D frees them (`UnretainedLedger`), so that an operator sees them: a warning once
per engine process, a metric, a column in ``kvferry nodes ls``. The ledger also holds
the other pins no retention names, the drafts the sidecar gave up on
(``sidecar.orphans``): the column shows them all. Pure: the tap and the sender do the
I/O.

What D pins is every block the request has at its finish: ``ceil(computed /
block_size)``, ``computed`` being vLLM's ``num_computed_tokens`` then, the prompt and
the output but the last token (sampled, never fed back). Blocks shared through D's
prefix cache with other requests are counted too: they are pinned as much.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from sidecar.capture import TurnObserver
from sidecar.orphans import OrphanBook

STREAM_WITHOUT_PARAMS = "stream_without_params"
"""The turns label of a streamed turn D pinned blocks for without saying which."""


def outcome_of(outcome: str, observer: TurnObserver, *, streamed: bool, with_prefill_params: bool) -> str:
    """The label of a turn that registered nothing, `outcome` as `TurnObserver.finished`
    said, told apart: STREAM_WITHOUT_PARAMS for a streamed answer that finished normally
    (one choice, no error) without params to a request that came with a prefill's.

    Any other answer without params pins nothing: a non-streamed one (the engine has no
    connector, or one without bidirectional transfer), one to a request without a
    prefill's params, one a stop string ended (``stop_reason`` is the string: vLLM's
    front end aborts the request in the engine, which then frees its blocks).
    """
    if (
        outcome == "no_params"
        and observer.params is None
        and streamed
        and with_prefill_params
        and not isinstance(observer.stop_reason, str)
    ):
        return STREAM_WITHOUT_PARAMS
    return outcome


def computed_tokens(observer: TurnObserver) -> int | None:
    """The tokens D had computed when the answer finished, from the answer's token ids
    (which the tap asks for), else from its usage; None when it showed neither."""
    prompt: int | None = None
    if observer.prompt_token_ids is not None:
        prompt = len(observer.prompt_token_ids)
    elif observer.prompt_ids_json is not None:  # (a compact list of integers: see cut_prompt_ids)
        ids = observer.prompt_ids_json
        prompt = ids.count(b",") + 1 if ids.strip(b"[]") else 0
    output = observer.output_token_ids
    if prompt is not None and output is not None:
        total = prompt + len(output)
    elif observer.usage is not None:
        total = sum(observer.usage)
    else:
        return None
    return max(total - 1, 0)


def pinned_blocks(tokens: int, block_size: int) -> int:
    """The blocks that hold `tokens` tokens."""
    return math.ceil(tokens / block_size) if block_size > 0 else 0


@dataclass
class UnretainedLedger:
    """Blocks the engine pins with no retention naming them, until its TTL frees them.

    `epoch` is the engine process (see EngineInstance.epoch): a new one holds nothing of
    the old one's, and a turn of an older one adds nothing.
    """

    ttl_s: float
    """The engine's decoder_kv_blocks_ttl."""
    epoch: int = 0
    turns: int = 0
    """Uncaptured turns since the sidecar started (every engine process)."""
    orphans: OrphanBook = field(default_factory=OrphanBook)
    """The drafts' pins no retention names (dropped registrations), by reason."""
    _expiries: list[tuple[float, int]] = field(default_factory=list)  # a heap of (expires at, blocks)
    _blocks: int = 0
    _warned: bool = False

    def restart(self, epoch: int) -> None:
        """A new engine process, `epoch`: the old one's blocks are gone with it."""
        self.epoch = epoch
        self._expiries.clear()
        self._blocks = 0
        self._warned = False
        self.orphans.restart(epoch)

    def add(self, epoch: int, blocks: int | None, finished_at: float) -> bool:
        """One uncaptured turn of engine process `epoch`, whose `blocks` (None = unknown) D
        pinned at `finished_at` (monotonic seconds). -> it is the first of this engine
        process (to warn about)."""
        self.turns += 1
        if epoch != self.epoch:
            return False  # its engine process is gone, and its blocks with it
        if blocks:
            heapq.heappush(self._expiries, (finished_at + self.ttl_s, blocks))
            self._blocks += blocks
        first, self._warned = not self._warned, True
        return first

    def uncaptured_blocks(self, now: float) -> int:
        """The uncaptured turns' blocks pinned now (monotonic seconds): those whose TTL ran
        out are freed."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            self._blocks -= heapq.heappop(expiries)[1]
        return self._blocks

    def by_reason(self, now: float, wall: float | None = None) -> dict[str, int]:
        """Every block pinned now that no retention names, by reason: the uncaptured turns'
        (STREAM_WITHOUT_PARAMS) and the orphans' (`now` monotonic, `wall` the wall-clock
        time then: the orphans' deadlines are D's, in wall-clock time; None = now)."""
        out = self.orphans.blocks(time.time() if wall is None else wall)
        out[STREAM_WITHOUT_PARAMS] = self.uncaptured_blocks(now)
        return out

    def blocks(self, now: float, wall: float | None = None) -> int:
        """Every block pinned now that no retention names (see `by_reason`)."""
        return sum(self.by_reason(now, wall).values())


def warning_detail(ttl_s: float) -> str:
    """What an operator reads when the first uncaptured turn of an engine process comes."""
    return (
        "this engine's streamed answers carry no kv_transfer_params (vLLM without PR 40186): "
        "streamed turns are not retained (the next turn recomputes its history), and the blocks "
        f"the engine pinned for each stay pinned until its decoder_kv_blocks_ttl ({ttl_s:g} s) "
        "with nothing to free them sooner (kvferry_sidecar_unretained_blocks, UNRETAINED in "
        "`kvferry nodes ls`). Have clients that can send non-streamed requests, or run an engine "
        "with PR 40186 (its streams' final chunk carries them)."
    )

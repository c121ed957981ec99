"""``kv_transfer_params`` of the NIXL connector: parsing, pull decisions, building.

Pure functions over plain data; the engine applies the decisions.

Two directions use the same pull:

- a decoder handed a prefiller's params (``do_remote_prefill: true``) pulls
  the prompt's blocks the prefiller holds;
- a prefiller handed a decoder's params (``do_remote_decode: true`` plus the
  decoder's ``remote_*`` keys, bidirectional transfer) pulls the blocks of the
  previous turn the decoder pinned.

How many tokens: ``min(remote_num_tokens, prompt_len) - locally_cached_tokens``.
Which blocks: the puller allocates ``k = ceil(count / block_size)`` new blocks
for its first uncached positions and fills them from the **tail** of the remote
list, ``remote_block_ids[g][-k:]``, like vLLM's NIXL worker. That is the right
KV exactly when the remote list covers the pulled range and nothing more, i.e.
when it holds ``ceil(min(remote_num_tokens, prompt_len) / block_size)`` blocks:
then the tail skips the first ``cached_blocks`` entries and D's leading blocks
land on the puller's leading uncached positions. A caller that wants a shorter
pull must therefore cut both ``remote_num_tokens`` and every
``remote_block_ids[g]`` to the leading blocks; cutting only the token count
pulls the wrong (trailing) blocks, as it would on a real engine.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from emulator.config import EXPIRY_SAFETY_MARGIN_S

_REQUIRED_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class PullDirection(enum.Enum):
    """Who hands the params to whom."""

    FROM_PREFILLER = "do_remote_prefill"
    """Decoder pulls the prompt a prefiller computed."""
    FROM_DECODER = "do_remote_decode"
    """Prefiller pulls the previous turn a decoder pinned (bidirectional)."""


@dataclass(frozen=True)
class RemoteBlocks:
    """Where remote KV lives, extracted from ``kv_transfer_params``."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int | None
    expiry_time: float | None
    registration_generation: int | None


class PullAction(enum.Enum):
    """What the puller does with remote KV."""

    PULL = "pull"
    SKIP = "skip"
    FAIL = "fail"


@dataclass(frozen=True)
class PullPlan:
    """A pull decision; for PULL, which remote blocks fill which local ones."""

    action: PullAction
    reason: str
    source: RemoteBlocks | None = None
    num_tokens: int = 0
    first_local_block: int = 0
    remote_block_ids: tuple[int, ...] = ()

    @property
    def notify(self) -> bool:
        """Whether the remote engine is told it may free its blocks (once the pull, if
        any, succeeded: see Engine._apply_plan)."""
        return self.source is not None and self.action is not PullAction.FAIL


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


def parse_remote(params: Mapping[str, Any] | None, direction: PullDirection) -> RemoteBlocks | None:
    """The remote blocks params point at, or None when they do not ask for a pull.

    A pull needs the direction's flag truthy, non-empty ``remote_block_ids`` and
    all of ``remote_engine_id, remote_request_id, remote_host, remote_port``.
    Raises ValueError on present but malformed values.
    """
    if not params or not params.get(direction.value):
        return None
    raw_ids = params.get("remote_block_ids")
    if not raw_ids or any(params.get(key) in (None, "") for key in _REQUIRED_KEYS):
        return None
    if not isinstance(raw_ids, list) or not all(isinstance(g, list) for g in raw_ids):
        raise ValueError("remote_block_ids must be a list of lists of block ids")
    # (``[[]]`` counts as blocks given, as in vLLM: a pull then finds too few of them)
    groups = tuple(tuple(map(int, group)) for group in raw_ids)
    if any(group and (min(group) < 0 or max(group) >= 2**63) for group in groups):  # C-level passes
        raise ValueError("remote_block_ids must be block ids (non-negative 64-bit integers)")
    port = _int_or_none(params["remote_port"])
    if port is None or not 0 < port < 65536:
        raise ValueError("remote_port must be a port number")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and not isinstance(expiry, int | float):
        raise ValueError("remote_blocks_expiry_time must be a number")
    # A prefiller pulling from a decoder takes ``remote_num_tokens or 0`` (none: it only
    # notifies D); a decoder pulling a prefill covers the prompt when P gives no count.
    remote_tokens = _int_or_none(params.get("remote_num_tokens"))
    return RemoteBlocks(
        engine_id=str(params["remote_engine_id"]),
        request_id=str(params["remote_request_id"]),
        host=str(params["remote_host"]),
        port=port,
        block_ids=groups,
        num_tokens=(remote_tokens or 0) if direction is PullDirection.FROM_DECODER else remote_tokens,
        expiry_time=None if expiry is None else float(expiry),
        registration_generation=_int_or_none(params.get("remote_registration_generation")),
    )


TOO_FEW_REMOTE_BLOCKS = "too_few_remote_blocks"
"""A pull whose remote block list is shorter than its tokens need: vLLM's worker asserts
(`_apply_prefix_caching`) and its engine process dies; the emulator counts it
(kvferry_emulator:connector_faults) and fails the request."""


def plan_pull(
    source: RemoteBlocks | None,
    *,
    prompt_len: int,
    cached_tokens: int,
    block_size: int,
    threshold: int,
) -> PullPlan:
    """Decide whether and what to pull (see the module doc for the block mapping). The
    source's expiry is not looked at here: vLLM's worker checks it at the read, after the
    scheduler admitted the request and its blocks were allocated (`too_close_to_expiry`)."""
    if source is None:
        return PullPlan(PullAction.SKIP, "no_remote_blocks")
    remote_tokens = prompt_len if source.num_tokens is None else source.num_tokens
    count = min(remote_tokens, prompt_len) - cached_tokens
    if remote_tokens <= 0:
        return PullPlan(PullAction.SKIP, "no_remote_tokens", source)
    if count <= 0:
        return PullPlan(PullAction.SKIP, "full_local_hit", source)
    if count < threshold:
        return PullPlan(PullAction.SKIP, "below_threshold", source)
    num_blocks = math.ceil(count / block_size)
    remote_ids = source.block_ids[0]
    if len(remote_ids) < num_blocks:
        return PullPlan(PullAction.FAIL, TOO_FEW_REMOTE_BLOCKS, source)
    return PullPlan(
        PullAction.PULL,
        "pull",
        source,
        num_tokens=count,
        first_local_block=cached_tokens // block_size,
        remote_block_ids=remote_ids[len(remote_ids) - num_blocks :],
    )


def too_close_to_expiry(
    source: RemoteBlocks, now: float, safety_margin: float = EXPIRY_SAFETY_MARGIN_S
) -> bool:
    """Whether a read of `source` at `now` (time.perf_counter) is refused, as vLLM's P
    refuses one within 5 s of D's deadline (a failed transfer: D is not notified)."""
    return source.expiry_time is not None and now >= source.expiry_time - safety_margin


@dataclass(frozen=True)
class HeldBlocks:
    """Blocks an engine holds for a remote reader, as it will describe them."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int
    expiry_time: float
    registration_generation: int
    tp_size: int


def describe_held_blocks(held: HeldBlocks, *, for_decoder: bool) -> dict[str, Any]:
    """The ``kv_transfer_params`` an engine returns for blocks it holds.

    ``for_decoder`` (a prefiller answering ``do_remote_decode``): the decoder
    gets ``do_remote_prefill: true``. Otherwise a decoder describes its pinned
    blocks for the next turn's prefiller: ``do_remote_decode: true``.
    """
    return {
        "do_remote_prefill": for_decoder,
        "do_remote_decode": not for_decoder,
        "remote_block_ids": [list(held.block_ids)],
        "remote_engine_id": held.engine_id,
        "remote_request_id": held.request_id,
        "remote_host": held.host,
        "remote_port": held.port,
        "tp_size": held.tp_size,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": held.num_tokens,
        "remote_blocks_expiry_time": held.expiry_time,
        "remote_registration_generation": held.registration_generation,
        "transfer_mode": "pull",
    }

"""A finished decode turn turned into a retention to register. Pure: no I/O.

- ``remote_host`` as vLLM reports it is its side-channel host, "localhost" by
  default: a loopback or unspecified address is rewritten to the side-channel
  host configured for this node, the one prefill nodes can reach.
- ``remote_blocks_expiry_time`` is D's ``time.perf_counter()`` deadline, i.e.
  CLOCK_MONOTONIC on Linux; the sidecar runs on the same host, so
  ``wall = time.time() + (deadline - time.perf_counter())``.
- The block digests cover D's sequence, ``(prompt + generated)[:remote_num_tokens]``,
  seeded by ``kvferry.digests.seed_for`` (the node's model, and the request's
  adapter when it names another model), exactly as the router seeds the
  prompt's digests. They are computed when the retention is registered
  (`digests_of`), when the node's model and block size are surely known.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.digests import block_digests, seed_for
from kvferry.urls import is_loopback
from sidecar.capture import FinishedTurn

#: Longest time ahead a deadline may lie; further means the clocks are not shared.
MAX_AHEAD_S = 3600.0


@dataclass(frozen=True)
class RetentionDraft:
    """A retention waiting to be registered."""

    tenant: str
    conversation_id: str
    params: dict[str, Any]
    """D's kv_transfer_params, remote_host rewritten; every other key as returned."""
    num_tokens: int
    expires_at: float
    """Wall-clock deadline of D's blocks (D's own, else the capture time + the blocks TTL)."""
    tokens: Sequence[int] | None
    """D's sequence (at most num_tokens ids), None when the engine did not return ids (or
    not valid ones). Kept as uint32 while the draft waits: 4 bytes an id, not a list's ~36
    (a 64k-token turn queued while the daemon is away is 256 KB, not 2.3 MB)."""
    model: str
    """The model the request named ("" = the base model)."""
    epoch: int
    """The engine instance (see EngineInstance.epoch) that holds the blocks."""
    request_id: str = ""
    """The request the blocks are held for (its X-Request-Id; "" = none came)."""
    attempts: int = 0
    seq: int = 0
    """Its place among the conversation's drafts (set by the queue: later = newer turn)."""


def rewrite_remote_host(params: dict[str, Any], side_channel_host: str) -> dict[str, Any]:
    """`params` with a loopback ``remote_host`` replaced (a new dict; others untouched)."""
    host = params.get("remote_host")
    if side_channel_host and (host is None or (isinstance(host, str) and is_loopback(host))):
        return {**params, "remote_host": side_channel_host}
    return params


def wall_deadline(expiry_mono: object, now_mono: float, now_wall: float) -> float | None:
    """D's perf_counter deadline in wall-clock time; None when absent or implausible.

    A deadline already past stays in the past (the caller drops the draft); one
    more than MAX_AHEAD_S ahead means the engine's clock is not ours.
    """
    if isinstance(expiry_mono, bool) or not isinstance(expiry_mono, int | float):
        return None
    left = float(expiry_mono) - now_mono
    if left > MAX_AHEAD_S:
        return None
    return now_wall + left


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def draft_retention(
    turn: FinishedTurn,
    *,
    tenant: str,
    conversation_id: str,
    model: str,
    epoch: int,
    side_channel_host: str,
    request_id: str = "",
    now_mono: float,
    now_wall: float,
    blocks_ttl_s: float,
) -> RetentionDraft | str:
    """The retention a finished D turn leaves behind, or why there is none (a metrics label).

    Without D's own deadline (remote_blocks_expiry_time, absent before vLLM sent it) the
    blocks are held `blocks_ttl_s` from when D's params came (D had finished), stamped
    here so that a registration that waits (daemon down, retries) cannot outlive them.
    No deadline is later than that either: D frees the blocks by then whatever its
    clock says (one on another host, or in another time namespace, is not ours)."""
    params = turn.params
    num_tokens = _int(params.get("remote_num_tokens"))
    if num_tokens is None or num_tokens <= 0:
        return "no_tokens"
    latest = (turn.params_seen_at or now_wall) + blocks_ttl_s
    expires_at = wall_deadline(params.get("remote_blocks_expiry_time"), now_mono, now_wall)
    expires_at = latest if expires_at is None else min(expires_at, latest)
    if expires_at <= now_wall:
        return "expired"
    tokens: array.array[int] | None = None
    if turn.prompt_token_ids is not None:
        try:
            tokens = array.array("I", (turn.prompt_token_ids + (turn.output_token_ids or []))[:num_tokens])
        except (OverflowError, TypeError):  # not token ids: no digests, as when none came
            tokens = None
    return RetentionDraft(
        tenant=tenant,
        conversation_id=conversation_id,
        params=rewrite_remote_host(params, side_channel_host),
        num_tokens=num_tokens,
        expires_at=expires_at,
        tokens=tokens,
        model=model,
        epoch=epoch,
        request_id=request_id,
    )


def digests_of(draft: RetentionDraft, base_model: str, block_size: int) -> bytes:
    """Block digests of the draft's sequence (b"" when unknown or not token ids)."""
    if not draft.tokens or block_size <= 0:
        return b""
    try:
        return block_digests(draft.tokens, block_size, seed_for(base_model, draft.model))
    except (ValueError, TypeError):
        return b""

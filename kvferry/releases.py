"""Requests that only make an engine free KV blocks on another ("releases").

A release is a completion request that carries the holder's kv_transfer_params as a
prefill's (``do_remote_prefill``) and is refused before admission: vLLM's serving layer
then has its connector notify the holder, which frees the blocks (PR 41269, "notify P
on pre-admission rejection"), and the engine that took the release allocates nothing,
so nothing is pinned anywhere. `stream` with `use_beam_search` on /v1/completions is
the refusal: vLLM checks it first, whatever the model or prompt (HTTP 400).

Released this way: D's blocks of a claim no turn will use, or of a revoked or replaced
retention (sent to a prefill node: the router, the sidecars, `kvferry leases revoke`),
and P's blocks of a turn D refused (sent to that D). The old way, a one-token request
with nothing to pull, made the engine that took it keep its own blocks for a reader
that never comes (P: its kv_lease_duration; D: decoder_kv_blocks_ttl, 480 s).

A notification needs the engine's NIXL handshake with the holder; vLLM makes one in the
background and sends the notification at the engine's next step. An idle engine takes
no step, so a release is followed by ticks: tiny requests with no params (nothing kept),
sent after the handshake has had time (`TICK_DELAYS_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from kvferry.v1 import nodes_pb2

#: The prompt of a release when the router has no token ids (a turn without reuse).
_RELEASE_PROMPT = "."
_PREFILLS = (nodes_pb2.PREFILL, nodes_pb2.BOTH)


def nothing_to_pull(params: Mapping[str, Any]) -> dict[str, Any]:
    """An engine's params with nothing to pull (``remote_num_tokens: 0``): the other side,
    handed them, only notifies the holder, which frees the blocks."""
    return {**params, "remote_num_tokens": 0}


def notifiable(params: Mapping[str, Any]) -> bool:
    """Whether a prefill node handed `params` (with nothing to pull) could tell their
    holder to free the blocks: the holder's engine, request, host and port are there."""
    port = params.get("remote_port")
    return (
        all(isinstance(params.get(k), str) and params.get(k) for k in _NOTIFY_KEYS)
        and isinstance(port, int)
        and not isinstance(port, bool)
        and 0 < port < 65536
    )


_NOTIFY_KEYS = ("remote_engine_id", "remote_request_id", "remote_host")


def release_body(model: Any, holder_params: Mapping[str, Any]) -> dict[str, Any]:
    """The release of the blocks `holder_params` name (an engine's own params, as it
    answered them: D's for D's blocks, P's for P's), for another engine to take."""
    kv = {**holder_params, "do_remote_prefill": True, "do_remote_decode": False, "remote_num_tokens": 0}
    kv.pop("prompt_token_ids", None)
    body: dict[str, Any] = {
        "prompt": _RELEASE_PROMPT,
        "max_tokens": 1,
        "stream": True,
        "use_beam_search": True,
        "kv_transfer_params": kv,
    }
    if isinstance(model, str):
        body["model"] = model
    return body


def released(status: int) -> bool:
    """Whether an engine's answer to `release_body` is the refusal that frees the blocks
    (any other answer: the release did not reach the connector, or was served)."""
    return status == 400


DEFAULT_TICK_DELAYS_S = (0.25, 2.0)


def tick_delays(raw: str | None) -> tuple[float, ...]:
    """Seconds after a release to send each tick, from ``KVFERRY_RELEASE_TICKS_S``
    (comma-separated; empty = no ticks, for engines that are never idle); unset or not
    numbers: the default (a handshake takes milliseconds on a LAN)."""
    if raw is None:
        return DEFAULT_TICK_DELAYS_S
    try:
        delays = tuple(sorted(float(x) for x in raw.split(",") if x.strip()))
    except ValueError:
        return DEFAULT_TICK_DELAYS_S
    return delays if all(0 <= d <= 60 for d in delays) else DEFAULT_TICK_DELAYS_S


TICK_DELAYS_S = tick_delays(os.environ.get("KVFERRY_RELEASE_TICKS_S"))


def tick_body(model: Any) -> dict[str, Any]:
    """A one-token request with no kv_transfer_params: a step for an idle engine to send
    a deferred notification in; nothing is kept for it."""
    body: dict[str, Any] = {"prompt": _RELEASE_PROMPT, "max_tokens": 1, "stream": False}
    if isinstance(model, str):
        body["model"] = model
    return body


#: POSTs a body to the engine's /v1/completions and answers the HTTP status (raises on failure).
Post = Callable[[dict[str, Any]], Awaitable[int]]


async def send_release(post: Post, model: Any, holder_params: Mapping[str, Any]) -> int:
    """Send a release through `post`, and when it took, the ticks after it; -> the
    release's HTTP status (`released` says whether it took). Ticks are best effort."""
    status = await post(release_body(model, holder_params))
    if released(status):
        waited = 0.0
        for delay in TICK_DELAYS_S:
            await asyncio.sleep(delay - waited)
            waited = delay
            with contextlib.suppress(Exception):  # (a lost tick costs only a later step)
                await post(tick_body(model))
    return status


def release_prefill(nodes: Iterable[nodes_pb2.Node], model: str, block_size: int) -> nodes_pb2.Node | None:
    """An alive prefill node to send D a release through: one serving `model` with
    `block_size` (D's params are in D's blocks of that model; "" and 0 match any) and an
    HTTP address, picked at random. None when there is none."""
    fits = [
        n
        for n in nodes
        if n.alive
        and n.role in _PREFILLS
        and (n.engine_url or n.http_url)
        and (not model or n.model == model)
        and (not block_size or n.block_size == block_size)
    ]
    return random.choice(fits) if fits else None


def engine_url(node: nodes_pb2.Node) -> str:
    """Where a node's engine takes OpenAI requests: its own URL when its sidecar
    advertises one, else the sidecar's (which relays them)."""
    return (node.engine_url or node.http_url).rstrip("/")

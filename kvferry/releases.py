"""Requests that only make an engine free KV blocks ("releases"): one-token completions
whose kv_transfer_params hold the other side's params with nothing to transfer. vLLM's
connector then only sends the notification that frees the blocks on the other side.
The router sends them, and a decode node's sidecar (for a retention replaced before
any turn claimed it)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
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


def release_body(
    model: Any, prefill_params: Mapping[str, Any], prompt_token_ids: Sequence[int] | None
) -> dict[str, Any]:
    """A one-token completion handing D P's params with nothing to pull, for a turn D
    refused: D's connector then only notifies P (vLLM sends the notification alone when a
    request has nothing to load), and P frees the blocks it kept for the turn now rather
    than at its timeout (480 s by default). A bidirectional D keeps this request's one
    block for its own TTL (it keeps every request that came with a prefill's params);
    D's sidecar registers nothing, as no conversation is named."""
    kv = {**nothing_to_pull(prefill_params), "do_remote_decode": False}
    kv.pop("prompt_token_ids", None)  # the prompt is the one token below
    return _one_token(model, kv, list(prompt_token_ids[:1]) if prompt_token_ids else _RELEASE_PROMPT)


def claim_release_body(model: Any, decode_params: Mapping[str, Any]) -> dict[str, Any]:
    """A one-token completion handing P D's params (a pull's or a release's) with nothing
    to pull, for a claim whose answer came after its turn went on without it: P's connector
    only notifies D, which frees the conversation's blocks now rather than at its TTL
    (480 s by default). P keeps this request's one block until its own timeout, as a
    producer keeps every request's blocks for a D that may read them."""
    kv = {**nothing_to_pull(decode_params), "do_remote_decode": True, "do_remote_prefill": False}
    kv.pop("prompt_token_ids", None)
    return _one_token(model, kv, _RELEASE_PROMPT)


def _one_token(model: Any, kv: dict[str, Any], prompt: str | list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": kv}
    if isinstance(model, str):
        out["model"] = model
    return out


def release_prefill(nodes: Iterable[nodes_pb2.Node], model: str, block_size: int) -> nodes_pb2.Node | None:
    """An alive prefill node to send D a release through: one serving `model` with
    `block_size` (D's params are in D's blocks of that model; "" and 0 match any) and an
    HTTP address, picked at random (each keeps the release's one block until its own
    timeout, so they share the cost). None when there is none."""
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

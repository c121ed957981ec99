"""Which engines serve a turn. Pure: plain data in, a node out.

- Prefill (P): least loaded, preferring the P whose prefix cache holds most of
  the prompt (Nodes/Score). A P caching more wins unless it is busier than the
  least loaded P by more than `load_slack` requests: a cached prefix saves
  compute, a queue costs all of it.
- Decode (D): least outstanding requests.
- Both among the nodes serving the requested model (`serving`).

Ties rotate with a counter the caller bumps, so equal nodes share the work.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFILL_ROLES = frozenset({"prefill", "both"})
DECODE_ROLES = frozenset({"decode", "both"})


@dataclass(frozen=True)
class Node:
    """An engine as the router routes to it."""

    engine_id: str
    """Stable id (the daemon's engine id; the URL for static nodes)."""
    role: str
    """prefill, decode or both."""
    url: str
    """Base URL requests go to (the node's sidecar when it has one)."""
    engine_url: str = ""
    """The engine's own server, for what no sidecar needs to see: tokenize and prefill
    requests (skipping the tap saves two hops); "" = use `url` (see `nodes.DirectRoutes`)."""
    model: str = ""
    """Base model ("" = unknown)."""
    block_size: int = 16
    """Tokens per KV block."""
    indexed_blocks: int = 0
    """Blocks the daemon's KV-event index holds for it (0: scoring it is pointless)."""

    @property
    def prefills(self) -> bool:
        return self.role in PREFILL_ROLES

    @property
    def decodes(self) -> bool:
        return self.role in DECODE_ROLES


def serving(nodes: Sequence[Node], model: object) -> Sequence[Node]:
    """The nodes for a request's ``model``: those whose base model it names (and those
    whose model is not known yet), when any names it; else all of them (a LoRA
    adapter's name, or no model: the engine judges it)."""
    if isinstance(model, str) and model and any(n.model == model for n in nodes):
        return [n for n in nodes if n.model in (model, "")]
    return nodes


def _rotate(best: list[Node], tiebreak: int) -> Node:
    return best[tiebreak % len(best)]


def _preferred(candidates: list[Node], avoid: Collection[str]) -> list[Node]:
    """`candidates` without those to `avoid`, unless that leaves none."""
    if not avoid:
        return candidates
    return [n for n in candidates if n.engine_id not in avoid] or candidates


def choose_decode(
    nodes: Sequence[Node],
    load: Mapping[str, int],
    tiebreak: int = 0,
    exclude: Collection[str] = (),
    block_size: int = 0,
    avoid: Collection[str] = (),
) -> Node | None:
    """The decode node with the fewest outstanding requests (None: there is none left):
    not one to `avoid` (lately unreachable) while another is left, and of `block_size`
    when any is (P's KV reaches D, and D's retention the next turn's digests, in blocks of
    that size)."""
    candidates = _preferred([n for n in nodes if n.decodes and n.engine_id not in exclude], avoid)
    if block_size:
        candidates = [n for n in candidates if n.block_size == block_size] or candidates
    if not candidates:
        return None
    least = min(load.get(n.engine_id, 0) for n in candidates)
    return _rotate([n for n in candidates if load.get(n.engine_id, 0) == least], tiebreak)


def alike(nodes: Sequence[Node], node: Node) -> list[Node]:
    """The prefill nodes that take what `node` was given: the same model (its tokenizer
    made the prompt's token ids) and block size (the digests, and D's params that a pull
    hands over, are in its blocks)."""
    return [n for n in nodes if n.prefills and n.model == node.model and n.block_size == node.block_size]


def fresh_retry_node(
    node: Node, nodes: Sequence[Node], tried: Collection[str], load: Mapping[str, int], unreachable: bool
) -> Node:
    """Where a prefill retried without the daemon's params goes: the same P, unless that P
    could not be reached; then another, whatever its block size (none of D's blocks ride
    along), or the same one again when there is none."""
    if not unreachable:
        return node
    return choose_prefill(prefill_candidates(nodes, exclude=tried), load) or node


def prefill_candidates(nodes: Sequence[Node], exclude: Collection[str] = ()) -> list[Node]:
    """Prefill-capable nodes, minus those already tried."""
    return [n for n in nodes if n.prefills and n.engine_id not in exclude]


def choose_prefill(
    nodes: Sequence[Node],
    load: Mapping[str, int],
    cached_blocks: Mapping[str, int] | None = None,
    *,
    exclude: Collection[str] = (),
    avoid: Collection[str] = (),
    load_slack: int = 4,
    tiebreak: int = 0,
) -> Node | None:
    """The prefill node for a prompt (None: there is none left): not one to `avoid` (lately
    unreachable) while another is left."""
    candidates = _preferred(prefill_candidates(nodes, exclude), avoid)
    if not candidates:
        return None
    least = min(load.get(n.engine_id, 0) for n in candidates)
    eligible = [n for n in candidates if load.get(n.engine_id, 0) <= least + load_slack]
    cached = cached_blocks or {}

    def key(n: Node) -> tuple[int, int]:
        return (-cached.get(n.engine_id, 0), load.get(n.engine_id, 0))

    best_key = min(key(n) for n in eligible)
    return _rotate([n for n in eligible if key(n) == best_key], tiebreak)


def cached_under_plain_hashes(body: Mapping[str, Any], nodes: Sequence[Node]) -> bool:
    """Whether vLLM caches the request's prompt under its plain block hashes (those the
    router computes and Nodes/Score matches): not with a ``cache_salt`` (its first
    block's hash carries the salt), nor for a LoRA adapter (a model no node names as its
    base, a node whose model is not known yet aside: every block's hash carries the
    adapter). Scoring those would steer them to
    nodes holding the plain prefix, which vLLM would not reuse for them."""
    if body.get("cache_salt"):
        return False
    model = body.get("model")
    return not isinstance(model, str) or not model or any(n.model in (model, "") for n in nodes)


def worth_scoring(nodes: Sequence[Node], exclude: Collection[str] = ()) -> bool:
    """Whether asking Nodes/Score can change the prefill choice: several P, some caching."""
    candidates = prefill_candidates(nodes, exclude)
    return len(candidates) > 1 and any(n.indexed_blocks > 0 for n in candidates)

"""Lookup decisions: a pure function of (retention, node, prompt, policy, now).

Nothing here does I/O. The rule is fail safe: when in doubt, recompute — a wasted
pull costs milliseconds, a wrong pull corrupts an answer.

vLLM facts this relies on (see DESIGN.md):
- P pulls ``min(remote_num_tokens, prompt) - locally_cached`` tokens and takes
  D's block list from its *tail*, so a shorter pull must cut ``remote_num_tokens``
  and every ``remote_block_ids[g]`` to the leading blocks;
- P recomputes below ``kv_recompute_threshold`` tokens;
- P always notifies D once handed params (D then frees the blocks), so a
  retention is handed out once; ``remote_num_tokens: 0`` frees without pulling;
- P refuses reads within 5 s of D's deadline, so nothing is handed out closer
  to expiry than the safety margin.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from controlplane.records import Claim, NodeState, Retention
from kvferry.digests import DIGEST_SIZE
from kvferry.limits import MAX_LIFETIME_S
from kvferry.verification import Held, verdict

# The keys P needs in order to pull (vLLM NixlConnector, P side).
REQUIRED_PARAM_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


class Reason(enum.StrEnum):
    """Why a lookup answered as it did: the `reason` strings of the API, every one of them.

    proto/kvferry/v1/leases.proto lists exactly these at `LookupResponse.reason` (a test
    compares the two); the router adds reasons of its own (router.decisions.Skip).
    """

    #: PULL: every token D holds that the prompt covers.
    PULL = "pull"
    #: PULL of a prefix: the prompt matches (or is as long as) part of D's tokens only.
    PARTIAL_PULL = "partial_pull"
    #: No retention for the conversation (never registered, revoked, or collected). (The
    #: API's string keeps the API's word for a retention.)
    NO_RETENTION = "no_lease"
    #: Past its deadline, or too close to it to hand out (the safety margin).
    EXPIRED = "expired"
    #: D's node is not alive (deregistered, suspended, or its liveness lapsed).
    NODE_GONE = "node_gone"
    #: D's engine restarted since the retention was registered: its blocks are gone.
    NODE_RESTARTED = "node_restarted"
    #: Fewer reusable tokens than P's recompute threshold: P would recompute anyway.
    BELOW_THRESHOLD = "below_threshold"
    #: The prompt's digests differ from D's sequence from its first block.
    PREFIX_MISMATCH = "prefix_mismatch"
    #: An earlier lookup took the retention (handed out once).
    ALREADY_CLAIMED = "already_claimed"
    #: etcd did not answer: nothing was decided on the retention.
    STORE_UNAVAILABLE = "store_unavailable"
    #: A Lookup sent with prompt_follows whose prompt never came, or was invalid.
    NO_PROMPT = "no_prompt"
    #: The retention was registered by the very request the Lookup is for (it came late):
    #: left unclaimed, for the conversation's next turn.
    OWN_TURN = "own_turn"
    #: The caller gave the prompt's digests, and D's retention has none to check them against.
    UNVERIFIABLE = "unverifiable"
    #: Only part of D's tokens would be pulled, and D's blocks can only be pulled whole
    #: (a KV-cache group holds freed blocks: see Retention.whole_only).
    WHOLE_ONLY = "whole_only"


@dataclass(frozen=True)
class Policy:
    """The knobs of the lookup decision."""

    # Hand nothing out this close to D's deadline (P itself refuses within 5 s).
    safety_margin_s: float = 10.0
    # Fewer reusable tokens than this: P would recompute anyway (vLLM's default 64).
    recompute_threshold: int = 64
    # Lifetime of a retention whose D sent no deadline (vLLM decoder_kv_blocks_ttl).
    default_lifetime_s: float = 480.0
    # Longest lifetime a registration may ask for.
    max_lifetime_s: float = MAX_LIFETIME_S

    def validate(self) -> None:
        """Raise ValueError for knobs P would defeat, or that contradict each other."""
        if self.safety_margin_s < 5.0:
            raise ValueError("safety margin must be at least 5 s: P refuses reads within 5 s of expiry")
        if self.recompute_threshold < 0:
            raise ValueError("recompute threshold must be >= 0")
        if not 0 < self.default_lifetime_s <= self.max_lifetime_s:
            raise ValueError("default lifetime must be positive and at most the maximum lifetime")


@dataclass(frozen=True)
class Prompt:
    """The prompt a lookup is for."""

    tokens: int
    digests: bytes | None = None
    """The digests of the prompt's full blocks. Given (even empty: a prompt shorter than
    one block), only what they verify is pulled; None: the caller vouches for the prompt."""
    caller_verifies: bool = False
    """The caller verifies the prompt itself, against D's digests handed back with the
    answer (`kvferry.verification`, the same rule): everything of D's sequence is handed
    out, as long as there are digests to verify it against."""


@dataclass(frozen=True)
class Handout:
    """How to turn D's stored kv_transfer_params into the params handed to P
    (`controlplane.convert.apply_handout` applies it to the stored bytes).

    Always sets ``do_remote_decode: true, do_remote_prefill: false``. A pull sets
    ``remote_num_tokens`` to `num_tokens` and cuts every ``remote_block_ids[g]``
    to its first `keep_blocks` entries; a release sets ``remote_num_tokens: 0``
    and keeps the block lists (P notifies D, which frees them).
    """

    num_tokens: int
    keep_blocks: int | None = None


RELEASE = Handout(0)


@dataclass(frozen=True)
class Decision:
    """A lookup's answer: PULL (with what to hand P) or RECOMPUTE (with why)."""

    pull: bool
    reason: Reason
    detail: str = ""
    # For PULL: what to hand P.
    params: Handout | None = None
    reusable_tokens: int = 0
    # For RECOMPUTE with a live retention: params that free D's blocks.
    release: Handout | None = None
    engine_id: str = ""


def decide(
    retention: Retention | None,
    node: NodeState | None,
    prompt: Prompt,
    policy: Policy,
    now: float,
) -> Decision:
    """PULL or RECOMPUTE for `prompt`, given the conversation's retention and its node."""
    if retention is None:
        return Decision(False, Reason.NO_RETENTION, "no retention for this conversation")
    dead = _not_held(retention, node, now)
    if dead is not None:
        return dead
    engine = retention.engine_id
    left = retention.expires_at - now
    if left < policy.safety_margin_s:
        return _recompute(
            Reason.EXPIRED, f"expires in {left:.1f}s (margin {policy.safety_margin_s:g}s)", RELEASE, engine
        )
    if prompt.caller_verifies:
        if not retention.digests:
            return _recompute(
                Reason.UNVERIFIABLE, "D registered no block digests for the caller to verify", RELEASE, engine
            )
        found = verdict(_held(retention), retention.num_tokens, None, policy.recompute_threshold, engine)
    else:
        found = verdict(_held(retention), prompt.tokens, prompt.digests, policy.recompute_threshold, engine)
    if not found.pull:
        return _recompute(Reason(found.reason), found.detail, RELEASE, engine)
    handout = Handout(found.tokens, found.keep_blocks(retention.block_size))
    return Decision(True, Reason(found.reason), found.detail, handout, found.tokens, None, engine)


def _held(retention: Retention) -> Held:
    return Held(retention.num_tokens, retention.block_size, retention.digests, retention.whole_only)


def _not_held(retention: Retention, node: NodeState | None, now: float) -> Decision | None:
    """RECOMPUTE without a release when D no longer holds the blocks (past the deadline,
    the node gone or restarted); None while it does."""
    engine = retention.engine_id
    if now >= retention.expires_at:
        return Decision(
            False, Reason.EXPIRED, f"expired {now - retention.expires_at:.1f}s ago", engine_id=engine
        )
    if node is None or not node.alive:
        detail = f"node {engine} is not alive"
        if node is not None and node.record.suspended_at:
            detail += " (suspended: no sidecar vouches for its engine process)"
        return Decision(False, Reason.NODE_GONE, detail, engine_id=engine)
    if node.record.generation != retention.generation:
        return Decision(
            False,
            Reason.NODE_RESTARTED,
            f"node {engine} is at generation {node.record.generation}, "
            f"retention was made under {retention.generation}",
            engine_id=engine,
        )
    return None


def decide_claimed(claim: Claim, now: float) -> Decision:
    """RECOMPUTE for a conversation whose retention a claim took (its marker is what is
    left): expired once the retention's deadline, when the marker knows it, has passed
    (nothing of it is held any more, whether or not that claim handed it out), else
    already_claimed."""
    taken = f"taken {now - claim.claimed_at:.1f}s ago"
    if claim.expires_at and now >= claim.expires_at:
        return Decision(False, Reason.EXPIRED, f"expired {now - claim.expires_at:.1f}s ago ({taken})")
    return Decision(False, Reason.ALREADY_CLAIMED, f"handed out {now - claim.claimed_at:.1f}s ago")


def _recompute(reason: Reason, detail: str, release: Handout, engine: str) -> Decision:
    return Decision(False, reason, detail, None, 0, release, engine)


def param_problems(params: dict[str, Any], num_tokens: int, block_size: int) -> list[str]:
    """What is wrong with D's kv_transfer_params, as field-named messages (empty = fine)."""
    problems: list[str] = []
    for key in REQUIRED_PARAM_KEYS:
        value = params.get(key)
        if value is None or value == "" or value == []:
            problems.append(f"kv_transfer_params.{key} is required")
    ids = params.get("remote_block_ids")
    if ids is not None and not isinstance(ids, list):
        problems.append("kv_transfer_params.remote_block_ids must be a list (of block id lists)")
    elif ids:
        groups = ids if isinstance(ids[0], list) else [ids]
        need = math.ceil(num_tokens / block_size) if block_size > 0 else 0
        for g, blocks in enumerate(groups):
            # (C-level passes: thousands of ids at long contexts; a bool is not a block id)
            if not isinstance(blocks, list) or not (
                set(map(type, blocks)) <= {int} and min(blocks, default=0) >= 0
            ):
                problems.append(f"kv_transfer_params.remote_block_ids[{g}] must be a list of block ids")
            elif len(blocks) < need:
                problems.append(
                    f"kv_transfer_params.remote_block_ids[{g}] has {len(blocks)} blocks, "
                    f"{num_tokens} tokens need {need}"
                )
    port = params.get("remote_port")
    if port is not None and not (isinstance(port, int) and 0 < port < 65536):
        problems.append("kv_transfer_params.remote_port must be a port number")
    rnt = params.get("remote_num_tokens")
    if rnt is not None and rnt != num_tokens:
        problems.append(
            f"kv_transfer_params.remote_num_tokens ({rnt}) differs from num_tokens ({num_tokens})"
        )
    if params.get("do_remote_decode") is False and params.get("do_remote_prefill") is True:
        problems.append("kv_transfer_params are a prefill node's (do_remote_prefill), not a decode node's")
    for key, value in params.items():
        if key != "remote_block_ids":  # (ints, checked above; thousands of them)
            where = _non_finite(value, f"kv_transfer_params.{key}")
            if where:  # JSON has no NaN: P would get null in its place
                problems.append(f"{where} must be a finite number")
    return problems


def _non_finite(value: Any, path: str) -> str:
    """The path of the first NaN or infinity in `value` ("" when there is none)."""
    if isinstance(value, float):
        return "" if math.isfinite(value) else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if found:
            return found
    return ""


#: vLLM's null block: what a KV-cache group's freed positions (a sliding window's) point at.
NULL_BLOCK_ID = 0


def holds_null_blocks(params: dict[str, Any]) -> bool:
    """Whether D's remote_block_ids name the null block in any group (valid params)."""
    ids = params.get("remote_block_ids") or []
    groups = ids if ids and isinstance(ids[0], list) else [ids]
    return any(NULL_BLOCK_ID in group for group in groups)


def digest_problem(field_name: str, digests: bytes, max_blocks: int | None = None) -> str | None:
    """What is wrong with a field of block digests, naming it (None = nothing)."""
    if len(digests) % DIGEST_SIZE:
        return f"{field_name} is {len(digests)} bytes, not a multiple of the digest size {DIGEST_SIZE}"
    if max_blocks is not None and len(digests) // DIGEST_SIZE > max_blocks:
        return (
            f"{field_name} has {len(digests) // DIGEST_SIZE} digests, more than the {max_blocks} full blocks"
        )
    return None

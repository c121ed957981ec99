"""How much of D's sequence a prompt may pull: the one rule, shared by the daemon (its
lookup decision, `controlplane.policy.decide`) and the router (which verifies its prompt
itself on a lookup sent with ``caller_verifies``, so that the daemon's answer need not
wait for the prompt). Pure: no I/O.

D's sequence is known by its tokens, its block size and the chained digests of its full
blocks (`kvferry.digests`); a prompt by its length and, when the caller verifies, the
digests of its own full blocks. Only the leading full blocks both sides digested alike
are pulled; P would recompute fewer than ``recompute_threshold`` tokens anyway; and
D's blocks marked whole-only (a KV-cache group holds freed blocks) are pulled whole or
not at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.digests import common_prefix_blocks

# The reasons, as the API spells them (controlplane.policy.Reason holds them all).
PULL = "pull"
PARTIAL_PULL = "partial_pull"
BELOW_THRESHOLD = "below_threshold"
PREFIX_MISMATCH = "prefix_mismatch"
UNVERIFIABLE = "unverifiable"
WHOLE_ONLY = "whole_only"


@dataclass(frozen=True)
class Held:
    """D's sequence as its retention describes it."""

    num_tokens: int
    block_size: int
    digests: bytes
    """The chained digests of its full blocks (empty: D registered none)."""
    whole_only: bool = False


@dataclass(frozen=True)
class Verdict:
    """What P may take of D's sequence: `tokens` (0: nothing) and why."""

    tokens: int
    reason: str
    detail: str

    @property
    def pull(self) -> bool:
        return self.reason in (PULL, PARTIAL_PULL)

    def keep_blocks(self, block_size: int) -> int:
        """D's leading blocks a pull of `tokens` reads (every remote_block_ids[g] is cut to them)."""
        return math.ceil(self.tokens / block_size)


def verdict(
    held: Held, prompt_tokens: int, prompt_digests: bytes | None, threshold: int, holder: str = "D"
) -> Verdict:
    """How much of `held` (on engine `holder`) a prompt of `prompt_tokens` may pull. With
    `prompt_digests` (even empty), only what they verify; None: the caller vouches for it."""
    reusable = min(held.num_tokens, prompt_tokens)
    if prompt_digests is not None:
        verified = _verified_tokens(held, prompt_tokens, prompt_digests)
        if isinstance(verified, Verdict):
            return verified
        if verified < reusable:
            found = Verdict(
                verified, PARTIAL_PULL, f"prompt matches D's sequence for {verified} of {reusable} tokens"
            )
        else:
            found = Verdict(reusable, PULL, f"{reusable} of {prompt_tokens} prompt tokens held by {holder}")
    elif reusable < held.num_tokens:
        detail = f"prompt is shorter than D's {held.num_tokens} tokens; {reusable} unverified"
        found = Verdict(reusable, PARTIAL_PULL, detail)
    else:
        found = Verdict(reusable, PULL, f"{reusable} of {prompt_tokens} prompt tokens held by {holder}")
    if held.whole_only and found.tokens < held.num_tokens:
        return Verdict(
            0,
            WHOLE_ONLY,
            f"{found.tokens} of D's {held.num_tokens} tokens, and a KV-cache group of D's holds "
            "freed (null) blocks: only a whole pull is safe",
        )
    if found.tokens < max(threshold, 1):
        return Verdict(0, BELOW_THRESHOLD, f"{found.tokens} reusable tokens < threshold {threshold}")
    return found


def _verified_tokens(held: Held, prompt_tokens: int, digests: bytes) -> int | Verdict:
    """Tokens of D's sequence the prompt's digests verify: the leading full blocks both
    sides digested alike, no more than the prompt's own full blocks (a caller may send
    more digests than its tokens cover). -> a Verdict when nothing is verified."""
    if not held.digests:
        return Verdict(0, UNVERIFIABLE, "D registered no block digests to verify the prompt's against")
    size = held.block_size
    blocks = min(common_prefix_blocks(held.digests, digests), prompt_tokens // size)
    if blocks:
        return blocks * size
    if prompt_tokens < size:  # nothing of it could be pulled anyway
        return Verdict(
            0,
            BELOW_THRESHOLD,
            f"prompt ({prompt_tokens} tokens) is shorter than one block ({size}): nothing to verify",
        )
    if not digests:
        return Verdict(0, PREFIX_MISMATCH, "no digests were given for the prompt's blocks")
    return Verdict(0, PREFIX_MISMATCH, "prompt differs from D's sequence in block 0")


def pull_params(params: Mapping[str, Any], tokens: int, keep_blocks: int) -> dict[str, Any]:
    """D's params (a decode node's, as handed out) for a pull of `tokens`: P pulls
    ``min(remote_num_tokens, prompt)`` tokens and takes D's blocks from the tail of each
    list, so both are cut to the pull (one flat list, as releases had before per-group
    lists, is cut as it is)."""
    out = {**params, "remote_num_tokens": tokens}
    groups = params.get("remote_block_ids")
    if isinstance(groups, list) and groups and isinstance(groups[0], list):
        out["remote_block_ids"] = [g[:keep_blocks] for g in groups]
    elif isinstance(groups, list):
        out["remote_block_ids"] = groups[:keep_blocks]
    return out

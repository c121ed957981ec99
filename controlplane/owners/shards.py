"""Which shard a conversation belongs to, each replica's fair share of the shards, and how
long an owner may go on deciding: pure functions of plain data, no I/O."""

from __future__ import annotations

import hashlib
import math

DEFAULT_SHARDS = 32
"""Shards when `--claim-shards` is not given."""


def shard_of(tenant: str, conversation_id: str, shards: int) -> int:
    """The shard of a conversation: a stable hash (the same on every replica and version)."""
    digest = hashlib.blake2b(f"{tenant}\0{conversation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def fair_share(shards: int, live_replicas: int) -> int:
    """The most shards one replica owns when `live_replicas` share them (at least 1 live)."""
    return math.ceil(shards / max(1, live_replicas))


def valid_until(sent_at: float, ttl_s: float, margin_s: float) -> float:
    """Until when (on the owner's monotonic clock) it may decide for its shards, after etcd
    acknowledged a keep-alive of its ownership lease sent at `sent_at`, the lease then
    having `ttl_s` left. etcd cannot expire the lease (and let another replica take a
    shard) before `sent_at + ttl_s`: the keep-alive reached it after it was sent.
    `margin_s` covers the two clocks' drift and the time a decision takes."""
    return sent_at + ttl_s - margin_s

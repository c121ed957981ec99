"""Which shard a conversation belongs to, and each replica's fair share of the shards:
pure functions of plain data, no I/O. (How long an owner may go on deciding:
controlplane.validity.)"""

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

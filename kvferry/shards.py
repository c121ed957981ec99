"""Which claim shard a conversation belongs to: the contract between the daemon replicas
(each shard has one owner, which decides its claims: controlplane.owners) and the routers
that send each lookup to that owner (Leases/Routes). Pure; the same on every replica,
router and version."""

from __future__ import annotations

import hashlib

DEFAULT_TENANT = "default"
"""The tenant of a request that names none (""): the one its shard is computed for."""


def shard_of(tenant: str, conversation_id: str, shards: int) -> int:
    """The shard of a conversation: a stable hash (the same on every replica and version)."""
    digest = hashlib.blake2b(f"{tenant}\0{conversation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards

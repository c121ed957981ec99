"""The bounds the daemon holds what the other processes send it to, shared so that each
process checks its settings against them at its start instead of being refused later;
and the one time bound a client keeps for the daemon's sake (ANSWER_VALID_S)."""

from __future__ import annotations

MAX_BLOCK_SIZE = 4096
"""Most tokens per KV block a node may register with."""
MIN_LIVENESS_TTL_S = 2
"""Shortest liveness TTL of a node: its heartbeats come every third of it."""
MAX_LIVENESS_TTL_S = 3600
"""Longest liveness TTL of a node (etcd's lease TTL bounds it)."""
MAX_LIFETIME_S = 3600.0
"""Furthest ahead a retention's deadline may lie (the daemon's default policy)."""
MAX_PORT = 65535
"""The largest TCP port number."""
ANSWER_VALID_S = 3.0
"""The longest after a lookup's op left that its answer may still be used: one that comes
later is a late answer (given to the caller's `late` hook, which releases what it hands
out), however long the caller would wait. The daemon's side of the contract
(controlplane.owners, "Why a retention is never handed out twice"): the replica that
answered decided the claim after the op left, and stopped deciding at the latest when its
ownership lease could lapse; a replica that takes its shards over uncleanly releases the
claimed blocks only `OwnerSettings.grace_s` + `margin_s` (6 s) after that. An answer used
within this bound leaves the pull it starts 3 s or more before such a release. (A replica
paused after deciding and resumed after a takeover would otherwise hand a slow caller a
claim whose blocks were freed meanwhile.)"""

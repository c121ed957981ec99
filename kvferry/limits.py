"""The bounds the daemon holds what the other processes send it to, shared so that each
process checks its settings against them at its start instead of being refused later."""

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

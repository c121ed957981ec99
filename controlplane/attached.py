"""What a node's sidecar tells its replica over the Attach stream, beyond liveness.

Kept in the memory of the replica the sidecar is attached to (never in etcd: no write
per heartbeat), dropped when the stream ends, and merged across replicas by Nodes/List,
each node's largest counts (only the replica it is attached to has any). Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.budget import Pool


@dataclass(frozen=True)
class AttachedCounts:
    """A node's counts as its sidecar reported them (see the proto's Node fields)."""

    indexed_blocks: int = 0
    """Blocks in the engine's prefix cache per its KV events (the replica's index)."""
    uncaptured_turns: int = 0
    """Turns the engine pinned blocks for that no retention names, since the sidecar started."""
    unretained_blocks: int = 0
    """The blocks those turns pin now."""
    pool_blocks: int = 0
    """The engine's KV pool, blocks in all (0 = unknown)."""
    pool_usage: float = 0.0
    """The share of it in use."""
    retained_blocks: int = 0
    """Blocks its live retentions hold, as the replica counts them."""

    def merged(self, other: AttachedCounts) -> AttachedCounts:
        """The largest of each count."""
        return AttachedCounts(
            max(self.indexed_blocks, other.indexed_blocks),
            max(self.uncaptured_turns, other.uncaptured_turns),
            max(self.unretained_blocks, other.unretained_blocks),
            max(self.pool_blocks, other.pool_blocks),
            max(self.pool_usage, other.pool_usage),
            max(self.retained_blocks, other.retained_blocks),
        )


@dataclass(frozen=True)
class Beat:
    """One heartbeat's report."""

    uncaptured_turns: int = 0
    unretained_blocks: int = 0
    pool: Pool = field(default_factory=lambda: Pool(0, 0.0))

"""Which KV blocks each node's prefix cache holds, from its KV events. Pure, in memory.

Fed by sidecars over Nodes/Attach (net-effect batches of vLLM BlockStored /
BlockRemoved / AllBlocksCleared); read by routers through Nodes/Score to pick the
prefill node that already caches most of a prompt. Each daemon replica indexes
the nodes attached to it; a restarted replica rebuilds from the sidecars.

A Python set of 64-bit ints costs ~70 bytes per block (int object + table slot),
and set.update / difference_update run at C speed (>10 M hashes/s).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class IndexUpdate:
    """One KvEventBatch: apply reset/cleared, then removed, then stored."""

    stored: Sequence[int]
    removed: Sequence[int] = ()
    cleared: bool = False
    reset: bool = False
    seq: int = -1


#: More cached blocks than any one engine holds (an H100's GPU and a large CPU tier hold a
#: few hundred thousand): past it, a node's index is a wrong or hostile stream's, and is
#: emptied rather than grow without bound (~70 MB per million).
MAX_BLOCKS_PER_NODE = 2_000_000


class BlockIndex:
    """The block hashes each node's prefix cache holds, per its KV events."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_NODE) -> None:
        self._blocks: dict[str, set[int]] = {}
        self.last_seq: dict[str, int] = {}
        self._max_blocks = max_blocks

    def apply(self, engine_id: str, u: IndexUpdate) -> bool:
        """Fold `u` into the node's blocks. -> False when that took the node past
        `max_blocks`: its index is emptied instead (scores 0 until a reset rebuilds it)."""
        blocks = self._blocks.get(engine_id)
        if blocks is None or u.reset or u.cleared:
            blocks = self._blocks[engine_id] = set()
        if u.removed:
            blocks.difference_update(u.removed)
        blocks.update(u.stored)
        self.last_seq[engine_id] = u.seq
        if len(blocks) > self._max_blocks:
            blocks.clear()
            return False
        return True

    def drop(self, engine_id: str) -> None:
        """Forget the node's blocks (its stream ended, or its record went)."""
        self._blocks.pop(engine_id, None)
        self.last_seq.pop(engine_id, None)

    def count(self, engine_id: str) -> int:
        """Blocks indexed for the node."""
        return len(self._blocks.get(engine_id, ()))

    def total(self) -> int:
        """Blocks indexed for every node."""
        return sum(len(b) for b in self._blocks.values())

    def contains(self, engine_id: str, block_hash: int) -> bool:
        """Whether the node holds the block."""
        return block_hash in self._blocks.get(engine_id, ())

    def leading(self, engine_id: str, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, the node holds.

        Block hashes are chained, so a block held at position k means the node computed
        the whole prefix before it, and vLLM evicts a sequence's blocks tail first: the
        prefix is most likely still there even where the index misses it (events lost
        before a sidecar (re)started: vLLM announces a block only when it is first
        cached, and a hot shared prefix never again). So past the leading run held, a
        few deeper positions are probed too, from the end, ever further apart."""
        blocks = self._blocks.get(engine_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        i, step = len(hashes) - 1, 1
        while i > n:
            if hashes[i] in blocks:
                return i + 1
            i -= step
            step *= 2
        return n

    def score(self, engines: Iterable[str], hashes: Sequence[int]) -> list[tuple[str, int]]:
        """(engine, leading cached blocks: see `leading`), best first, ties by engine id."""
        return sorted(((e, self.leading(e, hashes)) for e in engines), key=lambda x: (-x[1], x[0]))

"""Answers that span every daemon replica: Nodes/List's per-node counts and Nodes/Score's
scores, this replica's own merged with what its peers answer in time (peers.py asks).

A node's index and sidecar counts are only at the replica its sidecar is attached to;
every other replica has none of them. So each node takes its largest counts and its best
score over the replicas that answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import replace

from controlplane.attached import AttachedCounts
from controlplane.messages import counts_of
from controlplane.peers import Peers
from controlplane.service.attachments import Attachments
from controlplane.service.nodes import ListedNode, NodeRegistry
from kvferry.tasks import cancel_and_wait
from kvferry.v1 import nodes_pb2


class Cluster:
    """Node listings and scores over every replica."""

    def __init__(self, registry: NodeRegistry, attachments: Attachments, peers: Peers | None) -> None:
        self._registry = registry
        self._attachments = attachments
        self._peers = peers

    async def list_nodes(
        self, role: int, include_dead: bool, local_only: bool, time_left_s: float | None
    ) -> list[ListedNode]:
        """The nodes (of `role`, 0 = any; dead ones too if `include_dead`) with the largest
        counts any replica has of them. `local_only` (a peer asking): this replica's own
        counts, from memory, with no etcd read."""
        if local_only:
            return await self._registry.listed(role, include_dead, fresh=False)
        if self._peers is None:
            return await self._registry.listed(role, include_dead)
        asking = asyncio.ensure_future(self._peers.node_lists(time_left_s))
        try:
            listed = await self._registry.listed(role, include_dead)
        except BaseException:  # (etcd out, say: no use asking the peers meanwhile)
            await cancel_and_wait([asking])
            raise
        elsewhere = largest_counts(await asking)
        return [
            replace(n, counts=n.counts.merged(elsewhere[n.state.record.engine_id]))
            if n.state.record.engine_id in elsewhere
            else n
            for n in listed
        ]

    async def score(
        self, hashes: list[int], role: int, local_only: bool, time_left_s: float | None
    ) -> list[tuple[str, int]]:
        """Alive nodes of `role` (0 = any) by how many leading blocks of the prompt they
        cache, best first, each at its best count over the replicas. `local_only` (a peer
        asking): this replica's own index only."""
        scores = self._attachments.score(hashes, role)
        if local_only or self._peers is None:
            return scores
        answers = await self._peers.scores(hashes, role, time_left_s)
        return best_scores(scores, answers) if answers else scores  # (a lone replica's stand as they are)


def largest_counts(answers: Iterable[nodes_pb2.ListNodesResponse]) -> dict[str, AttachedCounts]:
    """Each node's largest counts over the replicas' answers."""
    out: dict[str, AttachedCounts] = {}
    for answer in answers:
        for n in answer.nodes:
            out[n.engine_id] = counts_of(n).merged(out.get(n.engine_id, AttachedCounts()))
    return out


def best_scores(
    own: list[tuple[str, int]], answers: Iterable[nodes_pb2.ScoreResponse]
) -> list[tuple[str, int]]:
    """Each node's best score over this replica's and the others' answers, best first
    (ties by engine id)."""
    best = dict(own)
    for answer in answers:
        for s in answer.scores:
            if s.cached_blocks > best.get(s.engine_id, s.cached_blocks):
                best[s.engine_id] = s.cached_blocks
    return sorted(best.items(), key=lambda x: (-x[1], x[0]))

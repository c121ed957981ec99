"""The router's own view of the discovered nodes. Pure: plain data in, the nodes to route to out.

Two sources, each believed for what it knows:

- The daemon's node list (``Nodes/List`` with the lapsed nodes too) says which nodes
  exist and what they are: a node it no longer lists was deregistered (or collected long
  after it died), and a new generation or address is a new engine process. Both are
  believed at once.
- The router's own ``/health`` probes of each node (through its sidecar, as turns reach
  it) say whether the engine answers. A node that fails `failures` probes in a row is
  left out, whatever the daemon says, and back when it answers again.

What the daemon cannot know is not taken from it: a node it lists as not alive because
its liveness lapsed (etcd stalled, the daemon hung, the sidecar cut off from every
replica) stays usable while its engine answers, if this router knew it alive before; so
does every node while the daemon cannot be asked. A control-plane outage costs reuse,
never the nodes: an etcd stall longer than the liveness TTL emptied the list, and turns
got 503 for seconds while every engine was healthy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from router.choice import Node


@dataclass(frozen=True)
class Listed:
    """A node as the daemon listed it."""

    node: Node
    alive: bool
    """Its liveness holds (its sidecar attached and heartbeating, as the daemon sees it)."""
    generation: int
    """Bumped by the daemon whenever the engine restarted."""


@dataclass(frozen=True)
class _Known:
    node: Node
    generation: int
    alive: bool
    """As last listed."""
    failures: int = 0
    """/health probes failed in a row."""


class NodeView:
    """The nodes the daemon listed, as this router's own probes find them."""

    def __init__(self, failures: int = 3) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        self._failures = failures
        self._known: dict[str, _Known] = {}

    def listed(self, listing: Iterable[Listed]) -> None:
        """The daemon answered `listing` (all its nodes, the lapsed ones too)."""
        before, known = self._known, {}
        for entry in listing:
            engine = entry.node.engine_id
            old = before.get(engine)
            if not entry.alive and old is None:
                continue  # (never seen alive by this router: nothing vouches for it)
            same = old is not None and old.generation == entry.generation and old.node.url == entry.node.url
            # A new process, or a new address: its probes start over.
            failures = old.failures if same and old is not None else 0
            known[engine] = _Known(entry.node, entry.generation, entry.alive, failures)
        # A lapsed node whose address a live node now has: that address is another engine's.
        taken = {k.node.url for k in known.values() if k.alive}
        self._known = {e: k for e, k in known.items() if k.alive or k.node.url not in taken}

    def probed(self, engine_id: str, url: str, ok: bool) -> bool:
        """A /health probe of `url` (the node's address when it was sent) answered 200 (`ok`)
        or not. -> whether the usable nodes changed. A probe of an address the node no
        longer has, or of a node no longer known, counts for nothing."""
        k = self._known.get(engine_id)
        if k is None or k.node.url != url:
            return False
        was = self._usable(k)
        self._known[engine_id] = replace(k, failures=0 if ok else k.failures + 1)
        return was != self._usable(self._known[engine_id])

    def _usable(self, k: _Known) -> bool:
        return k.failures < self._failures

    @property
    def nodes(self) -> list[Node]:
        """The nodes to route to, by engine id."""
        return [k.node for e, k in sorted(self._known.items()) if self._usable(k)]

    @property
    def probed_nodes(self) -> Sequence[Node]:
        """Every node known, usable or not (a node left out comes back when it answers)."""
        return [k.node for k in self._known.values()]

    @property
    def lapsed(self) -> list[str]:
        """The usable nodes the daemon lists as not alive (kept on their own health)."""
        return sorted(e for e, k in self._known.items() if not k.alive and self._usable(k))

    @property
    def failing(self) -> list[str]:
        """The nodes left out for failing their probes."""
        return sorted(e for e, k in self._known.items() if not self._usable(k))

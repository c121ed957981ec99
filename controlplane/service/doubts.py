"""Which nodes this replica's view may not decide a pull on alone, even while it is
trusted (controlplane.solewriter): a node written with no answer from etcd, and a node
another replica told of demoting (controlplane.notices). A lookup confirms those by a read
(service/nodecache.py) until a read begun late enough covers them."""

from __future__ import annotations

import collections
import time

from controlplane.solewriter import SoleWriter

_ENDED_KEPT = 4096
"""How many demotions told over are remembered (a notice of one that comes late is dropped)."""


class Doubts:
    """Nodes in doubt, and whether the view decides a node's pull with no read (`sole`)."""

    def __init__(self, writer: SoleWriter | None) -> None:
        """`writer`: this replica's standing as a node writer (None: every pull is confirmed)."""
        self._writer = writer
        self._unsure: dict[str, float] = {}
        """engine -> monotonic time one of its writes had no answer and could apply no more
        since: a read begun later (any, serializable too) covers it."""
        self._unsettled: collections.Counter[str] = collections.Counter()
        """engine -> demoting writes this replica made with no answer that may still apply
        (store.fenced settles each): no read covers them until then."""
        self._noticed: dict[str, dict[tuple[str, int], float]] = {}
        """engine -> the demotions of it other replicas told of and are not over: (replica,
        number) -> monotonic time the notice came."""
        self._over: dict[str, float] = {}
        """engine -> monotonic time another replica's demotion of it was over: a linearizable
        read of every node begun later covers it (a serializable one may come from an etcd
        member that has not applied that write yet)."""
        self._ended: collections.deque[tuple[str, int]] = collections.deque(maxlen=_ENDED_KEPT)

    def sole(self, engine_id: str) -> bool:
        """Whether this replica's view of `engine_id` is etcd's without a read: it knows every
        node change since its last read (controlplane.solewriter), and how each went."""
        return (
            self._writer is not None
            and engine_id not in self._unsure
            and engine_id not in self._unsettled
            and engine_id not in self._noticed
            and engine_id not in self._over
            and self._writer.trusted()
        )

    def unsure(self, engine_id: str, settled: bool = True) -> None:
        """A write to `engine_id` had no answer; `settled`: it can apply no more (else
        `settled` is called once it cannot)."""
        if settled:
            self._unsure[engine_id] = time.monotonic()
        else:
            self._unsettled[engine_id] += 1

    def settled(self, engine_id: str) -> None:
        """A write `unsure(..., settled=False)` can apply no more: a read begun from now covers it."""
        self._unsettled[engine_id] -= 1
        if self._unsettled[engine_id] <= 0:
            del self._unsettled[engine_id]
        self.unsure(engine_id)

    def demoting(self, engine_id: str, replica: str, number: int) -> None:
        """`replica` is about to write its demotion `number` of `engine_id`."""
        if (replica, number) not in self._ended:  # (a notice that comes after its end: over)
            self._noticed.setdefault(engine_id, {})[(replica, number)] = time.monotonic()

    def demoted(self, engine_id: str, replica: str, number: int) -> None:
        """That demotion is over: a read of every node begun from now covers it."""
        self._ended.append((replica, number))
        told = self._noticed.get(engine_id, {})
        told.pop((replica, number), None)
        if not told:
            self._noticed.pop(engine_id, None)
        self._over[engine_id] = time.monotonic()

    def loaded(self, started: float) -> None:
        """A linearizable read of every node begun at monotonic `started` is in the view: it
        covers what was in doubt before it, and the demotions told of before it by replicas
        it found gone (their later writes fail their fence)."""
        self._unsure = {e: at for e, at in self._unsure.items() if at >= started}
        self._over = {e: at for e, at in self._over.items() if at >= started}
        if self._writer is not None:
            there = self._writer.view_replicas
            noticed = {
                e: {n: at for n, at in told.items() if n[0] in there or at >= started}
                for e, told in self._noticed.items()
            }
            self._noticed = {e: told for e, told in noticed.items() if told}

    def read(self, engine_id: str, started: float) -> None:
        """A read of `engine_id` begun at monotonic `started` is in the view."""
        if self._unsure.get(engine_id, started) < started:
            del self._unsure[engine_id]

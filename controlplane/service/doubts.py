"""Which nodes this replica's view may not decide a pull on alone, even while it is
trusted (controlplane.solewriter): a node whose write had no answer, and a node another
replica told of demoting (controlplane.notices). A lookup confirms those by a read (service/
nodecache.py) until a read begun late enough covers them."""

from __future__ import annotations

import time

from controlplane.solewriter import SoleWriter


class Doubts:
    """Nodes in doubt, and whether the view decides a node's pull with no read (`sole`)."""

    def __init__(self, writer: SoleWriter | None) -> None:
        """`writer`: this replica's standing as a node writer (None: every pull is confirmed)."""
        self._writer = writer
        self._unsure: dict[str, float] = {}
        """engine -> monotonic time a write to it had no answer, or another replica's
        demotion of it was over: confirmed by a read begun later."""
        self._noticed: dict[str, set[tuple[str, int]]] = {}
        """engine -> the demotions of it other replicas told of and are not over (replica,
        number): confirmed by reads meanwhile."""

    def sole(self, engine_id: str) -> bool:
        """Whether this replica's view of `engine_id` is etcd's without a read: it knows every
        node change since its last read (controlplane.solewriter), and how each went."""
        return (
            self._writer is not None
            and engine_id not in self._unsure
            and engine_id not in self._noticed
            and self._writer.trusted()
        )

    def unsure(self, engine_id: str) -> None:
        """A write to `engine_id` had no answer (it may still apply)."""
        self._unsure[engine_id] = time.monotonic()

    def demoting(self, engine_id: str, replica: str, number: int) -> None:
        """`replica` is about to write its demotion `number` of `engine_id`."""
        self._noticed.setdefault(engine_id, set()).add((replica, number))

    def demoted(self, engine_id: str, replica: str, number: int) -> None:
        """That demotion is over: a read begun from now covers it."""
        told = self._noticed.get(engine_id, set())
        told.discard((replica, number))
        if not told:
            self._noticed.pop(engine_id, None)
        self.unsure(engine_id)

    def loaded(self, started: float) -> None:
        """A read of every node begun at monotonic `started` is in the view: it covers the
        writes in doubt before it, and every demotion of a replica it found gone (that
        replica's later writes fail their fence)."""
        self._unsure = {e: at for e, at in self._unsure.items() if at >= started}
        if self._writer is not None:
            there = self._writer.view_replicas
            noticed = {e: {n for n in told if n[0] in there} for e, told in self._noticed.items()}
            self._noticed = {e: told for e, told in noticed.items() if told}

    def read(self, engine_id: str, started: float) -> None:
        """A read of `engine_id` begun at monotonic `started` is in the view."""
        if self._unsure.get(engine_id, started) < started:
            del self._unsure[engine_id]

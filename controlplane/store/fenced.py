"""How every write of a node record is made (store/nodes.py): fenced by this replica's
announcement (controlplane.solewriter), a demoting one told to the other replicas first
(controlplane.notices), and its outcome told to this replica's view (`NodeWrites`); one
etcd did not answer is settled before it is over (`_settle`)."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog
from aetcd import rpc

from controlplane.errors import StoreUnavailable
from controlplane.notices import Demotion, NoticeSender
from controlplane.records import Keys, NodeState
from controlplane.solewriter import SoleWriter
from controlplane.store.kv import EtcdKv, get, mod_is, on_lease, put_op, range_op
from kvferry.tasks import cancel_and_wait, spawn

log = structlog.get_logger(__name__)

_SETTLE_FIRST_S = 0.1
"""How soon a write with no answer is settled again after a try that failed (doubling)."""
_SETTLE_MAX_S = 5.0


class NodeWrites(Protocol):
    """Who is told of each node write this replica made, once etcd acknowledged it."""

    def stored(self, state: NodeState, revision: int) -> None:
        """A node's record written, at mod `revision`."""

    def extended(self, engine_id: str, lease_id: int, until: float) -> None:
        """The liveness of the registration on `lease_id` now ends at `until`."""

    def deleted(self, engine_id: str) -> None:
        """A node's record deleted."""

    def unsure(self, engine_id: str, settled: bool = True) -> None:
        """A write to a node whose outcome is unknown (etcd did not answer in time);
        `settled`: it can apply no more (else `settled` is told once it cannot)."""

    def settled(self, engine_id: str) -> None:
        """A write told `unsure(..., settled=False)` can apply no more."""


class Unobserved:
    """A NodeWrites told nothing (a store with no view of the nodes)."""

    def stored(self, state: NodeState, revision: int) -> None:
        pass

    def extended(self, engine_id: str, lease_id: int, until: float) -> None:
        pass

    def deleted(self, engine_id: str) -> None:
        pass

    def unsure(self, engine_id: str, settled: bool = True) -> None:
        pass

    def settled(self, engine_id: str) -> None:
        pass


class FencedWrites:
    """Node writes, fenced and told (`write`)."""

    def __init__(self, kv: EtcdKv, keys: Keys, writer: SoleWriter | None) -> None:
        """`writer`: this replica's standing as a node writer (None: writes carry no fence)."""
        self._kv = kv
        self._keys = keys
        self._writer = writer
        self.observer: NodeWrites = Unobserved()
        self.notices: NoticeSender | None = None
        """Tells the other replicas of a demoting write first (controlplane.notices; None:
        nobody holds a promise, as in a store used outside a daemon)."""
        self._settling: set[asyncio.Task[None]] = set()

    async def write(
        self,
        op: str,
        engine_id: str,
        compare: list[rpc.Compare],
        writes: list[rpc.RequestOp],
        demotes: bool = True,
        settle_revision: int = 0,
    ) -> rpc.TxnResponse:
        """A write to a node's keys, fenced (controlplane.solewriter): it applies only while
        this replica's announcement is on the lease it was announced on, and raises
        StoreUnavailable when that is what failed; one that `demotes` the node waits for rule
        3 first, then tells the replicas holding a promise (controlplane.notices). A write
        whose outcome is unknown (etcd did not answer, or the caller was cancelled
        meanwhile) is told to the observer; a demoting one that compares the node key's mod
        revision `settle_revision` is then settled (`_settle`) before it is over."""
        lease, fence, check = 0, [], []
        if self._writer is not None:
            lease = await self._writer.fence(self._writer.grace_s + self._kv.timeout, demotes)
            key = self._keys.replica(self._writer.me)
            fence, check = [on_lease(key, lease)], [range_op(key)]
        demotion = await self.notices.before(engine_id) if demotes and self.notices else None
        try:
            resp = await self._kv.txn(op, compare + fence, writes, check)
        except BaseException:  # (no answer, or the caller gave up waiting: it may have applied)
            if demotes and settle_revision:
                self.observer.unsure(engine_id, settled=False)
                spawn(self._settle(engine_id, settle_revision, demotion), self._settling)
            else:
                self.observer.unsure(engine_id)
                self._over(demotion)
            raise
        self._over(demotion)
        if not resp.succeeded and check:
            held = resp.responses[0].response_range.kvs
            if not held or held[0].lease != lease:
                assert self._writer is not None
                self._writer.withdrawn()
                raise StoreUnavailable(
                    f"{engine_id} not written ({op}): this replica's announcement in etcd lapsed; "
                    "it writes no node record until it has announced itself again"
                )
        return resp

    def _over(self, demotion: Demotion | None) -> None:
        if demotion is not None and self.notices is not None:
            self.notices.after(demotion)

    async def _settle(self, engine_id: str, revision: int, demotion: Demotion | None) -> None:
        """A demoting write with no answer may still apply later (etcd may have it in its
        log): make sure it cannot, by finding the node key moved past `revision` (the mod
        revision it compares) or moving it there with its own value; until then the view and
        the replicas told keep that node on confirming reads."""
        key, delay = self._keys.node(engine_id), _SETTLE_FIRST_S
        while True:
            try:
                (read,) = await self._kv.read("settle_node", get(key))
                if read.kvs and int(read.kvs[0].mod_revision) == revision:
                    await self._kv.txn(
                        "settle_node", [mod_is(key, revision)], [put_op(key, read.kvs[0].value)], []
                    )
                break
            except Exception as e:  # (etcd out: tried again; the node stays in doubt meanwhile)
                log.info("node.settle_failed", engine_id=engine_id, error=str(e))
                await asyncio.sleep(delay)
                delay = min(2 * delay, _SETTLE_MAX_S)
        log.info("node.write_settled", engine_id=engine_id, revision=revision)
        self.observer.settled(engine_id)
        self._over(demotion)

    async def close(self) -> None:
        """Stop settling writes (their nodes stay in doubt in a view that is going anyway)."""
        await cancel_and_wait(list(self._settling))

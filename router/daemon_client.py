"""The router's client of the daemon replicas: lookups, node lists and prefix scores.

Every call has a short deadline and turns any failure into plain data the
caller can serve without reuse: nothing here raises for a daemon that is slow,
gone or confused. Lookups go over one multiplexed ``Leases/Stream`` (the lookup
stream, ``kvferry.leaseclient.LeaseStream``) per replica; a replica that fails hands
the next call to the next replica. A `Breaker` stops lookups for a moment after
failures, so a dead daemon costs a turn nothing instead of a deadline.

With TLS files, the channels are TLS with the router's certificate as its identity
(mTLS); a rotated certificate goes out only on a new channel, so `rotate_if_changed`
re-makes every replica's channel and retires the old ones once their calls are over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from kvferry.leaseclient import LeaseOpError
from kvferry.security.tls import TlsFiles, client_ssl_context
from kvferry.structs import struct_to_dict
from kvferry.tasks import cancel_and_wait, spawn
from kvferry.v1 import leases_pb2, nodes_pb2
from kvferry.verification import Held
from router.choice import Node
from router.decisions import Breaker, LookupAnswer, Reuse, Skip, reuse_of, skipped, verified_reuse
from router.replica import Replica
from router.routes import Owner, OwnerReplicas, routes_of
from router.settings import DaemonSettings
from router.view import Listed

log = structlog.get_logger(__name__)

_ROLES = {nodes_pb2.PREFILL: "prefill", nodes_pb2.DECODE: "decode", nodes_pb2.BOTH: "both"}
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
_STREAM_PROBE = "kvferry-router-stream-probe"
"""The conversation of the peek that sets the lookup stream up (no client's: the default tenant's)."""


def answer_of(res: leases_pb2.LookupResponse) -> LookupAnswer:
    """A LookupResponse as plain data."""
    check = None
    if res.HasField("check"):
        c = res.check
        check = Held(c.num_tokens, c.block_size, c.block_digests, c.whole_only)
    return LookupAnswer(
        pull=res.decision == leases_pb2.PULL,
        reason=res.reason,
        params=struct_to_dict(res.kv_transfer_params),
        release=struct_to_dict(res.release_params),
        reusable_tokens=res.reusable_tokens,
        check=check,
        threshold=res.check.recompute_threshold,
    )


def node_of(n: nodes_pb2.Node) -> Node | None:
    """A listed node as the router routes to it (None: unusable, e.g. no URL or role)."""
    role = _ROLES.get(n.role)
    if role is None or not n.http_url:
        return None
    return Node(
        engine_id=n.engine_id,
        role=role,
        url=n.http_url.rstrip("/"),
        engine_url=n.engine_url.rstrip("/"),
        model=n.model,
        block_size=n.block_size or 16,
        indexed_blocks=n.indexed_blocks,
    )


#: Lookups in a row a daemon replica answers late after which the next go to another.
LATE_FAILOVER = 3
LATE_TRIPS = 2
"""Late answers in a row (lookups sent after the last late one) that open the breaker."""
RETIRE_AFTER_S = 60.0
"""How long the channel of a replica replaced on a certificate rotation is kept for the
calls that started on it (a lookup waits for its prompt, then its deadline); the
answers it still owes are awaited after that (`DaemonSettings.late_answer_s`)."""


@dataclass(frozen=True)
class Ended:
    """What the daemon did when a conversation ended."""

    found: bool
    """A retention of it was revoked."""
    released_by_node: bool
    """D's sidecar was told to free the blocks."""
    release_params: dict[str, Any] | None
    """Else, D's params to free them with (None: nothing is left to free)."""
    engine_id: str


class DaemonClient:
    """Lookups, node lists and scores against the daemon replicas, failing over between them."""

    def __init__(
        self, addresses: Sequence[str], settings: DaemonSettings, tls: TlsFiles | None = None
    ) -> None:
        self._s = settings
        # (its own TlsFiles: what changed is seen once per watcher)
        self._tls = None if tls is None else TlsFiles(tls.ca, tls.cert, tls.key)
        if self._tls is not None:
            self._tls.changed()
        streams = settings.stream_addresses or ("",) * len(addresses)
        self._replicas = [
            Replica(a, settings.late_answer_s, self._tls, f) for a, f in zip(addresses, streams, strict=True)
        ]
        self._current = 0
        self.breaker = Breaker(settings.breaker_base_s, settings.breaker_max_s)
        self._reopening: asyncio.Task[None] | None = None
        self._stream_wanted = False
        """A lookup stream was set up ahead of the turns (`open_stream`): again after a rotation."""
        self._retired: list[Replica] = []
        """Replicas replaced on a rotation, until closed (`_retire`)."""
        self._retiring: set[asyncio.Task[None]] = set()
        self.owners = OwnerReplicas(self._owner_replica)
        """Where each conversation's lookups go (its shard's owner: router.routes)."""
        self._routed = settings.owner_routes
        """Whether to ask for routes (off: every lookup to the replica in use)."""
        self._opening: set[asyncio.Task[None]] = set()

    @property
    def _replica(self) -> Replica:
        return self._replicas[self._current]

    def _owner_replica(self, owner: Owner) -> Replica:
        """The replica an owner's lookups go to: a configured one at its address, else a new one."""
        for r in self._replicas:
            if r.address == owner.address:
                return r
        return Replica(owner.address, self._s.late_answer_s, self._tls, owner.stream_address)

    async def refresh_routes(self) -> None:
        """Learn which replica decides each conversation's lookups (Leases/Routes, asked of
        the replica in use). On a failure the routes stay as they were: a lookup that
        reaches a replica no longer owning its shard is forwarded all the same. A daemon
        that does not serve them (older, or refusing) is not asked again."""
        if not self._routed:
            return
        replica = self._replica
        try:
            res = await replica.leases.Routes(leases_pb2.RoutesRequest(), timeout=self._s.rpc_timeout_s)
            made, gone = self.owners.learn(routes_of(res, bool(self._s.stream_addresses)))
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                self._routed = False  # (and the routes learned before: every lookup to the replica in use)
                self._retire_owners(self.owners.forget())
                log.warning("router.routes.off", address=replica.address, code=e.code().name)
            else:
                log.debug("router.routes.failed", address=replica.address, code=e.code().name)
            return
        except Exception as e:  # (an owner's address a channel cannot take, say: the routes as they were)
            log.warning("router.routes.unusable", address=replica.address, error=repr(e))
            return
        for r in made:  # (set up before a turn needs it: see open_stream)
            spawn(self._open_owner(r), self._opening)
        self._retire_owners(gone)
        if made or gone:
            log.info("router.routes.changed", owners=[r.address for r in self.owners.all()])

    def _retire_owners(self, replicas: list[Replica]) -> None:
        for r in replicas:
            if r not in self._replicas:  # (a configured replica stays)
                self._retire_later(r)

    async def _open_owner(self, replica: Replica) -> None:
        """Set an owner's lookup stream up; one that cannot be is left out a while (its
        conversations go to the replica in use) rather than failing a turn's lookup."""
        if not await self._open(replica):
            self.owners.shun(replica.address)

    def _failover(self, failed: Replica) -> None:
        if self._replica is failed and len(self._replicas) > 1:
            self._current = (self._current + 1) % len(self._replicas)
            log.info("router.daemon.failover", address=self._replica.address)

    async def open_stream(self) -> None:
        """Set the lookup stream to the daemon up before a turn needs it (a peek that claims
        nothing). A lookup sent on a stream still being set up can miss its deadline, and
        if its claim then reaches the daemon after the turn's own retention was
        registered, it takes that one: the next turn loses its reuse. A failure here is
        only logged: turns set the stream up themselves."""
        self._stream_wanted = True
        await self._open(self._replica)

    async def _open(self, replica: Replica) -> bool:
        """Set `replica`'s lookup stream up (see `open_stream`); -> whether it answered."""
        try:
            await replica.stream.lookup(
                leases_pb2.LookupRequest(conversation_id=_STREAM_PROBE, peek=True), self._s.rpc_timeout_s
            )
        except LeaseOpError as e:
            log.info(
                "router.daemon.stream_not_ready", address=replica.address, code=e.code.name, error=e.message
            )
            return False
        return True

    def rotate_if_changed(self) -> bool:
        """Re-make every replica's channel when the TLS files changed (a client certificate
        goes only with a new channel); -> whether it did. Files that do not load (a
        rotation half-written) are tried again at the next call; the channels stay."""
        if self._tls is None or not self._tls.changed():
            return False
        try:
            client_ssl_context(self._tls)  # (loads them all: the check that they are whole)
        except (OSError, ValueError) as e:  # (ssl.SSLError is an OSError)
            self._tls.forget()
            log.warning("router.daemon.tls_reload_failed", cert=str(self._tls.cert), error=str(e))
            return False
        old = self._replicas
        self._replicas = [Replica(r.address, self._s.late_answer_s, self._tls, r.stream_address) for r in old]
        for replica in old:
            self._retire_later(replica)
        self._retire_owners([r for r in self.owners.forget() if r not in old])
        if self._stream_wanted:
            self._reopen()
        log.info("router.daemon.tls_rotated", cert=str(self._tls.cert))
        return True

    def _retire_later(self, replica: Replica) -> None:
        self._retired.append(replica)
        spawn(self._retire(replica), self._retiring)

    async def _retire(self, replica: Replica) -> None:
        """Close a replaced replica once the calls that started on it are over."""
        await asyncio.sleep(RETIRE_AFTER_S)
        await replica.stream.owed_answers(self._s.late_answer_s)
        await replica.close()
        self._retired.remove(replica)

    def _reopen(self) -> None:
        """Set a new lookup stream up in the background while the breaker holds lookups back,
        so the first lookup after it does not wait on the set-up (see `open_stream`)."""
        if self._reopening is None or self._reopening.done():
            self._reopening = asyncio.get_running_loop().create_task(self.open_stream())

    async def lookup_early(
        self,
        tenant: str,
        conversation_id: str,
        prompt: asyncio.Future[tuple[Sequence[int], bytes] | None],
        answered_late: Callable[[Reuse], None] | None = None,
        request_id: str = "",
        wait_s: Callable[[int], float] | None = None,
    ) -> Reuse:
        """Claim the conversation's retention for a prompt; any failure = serve without reuse.

        Sent before the prompt is known (caller_verifies): the daemon claims and answers
        while `prompt` (the token ids and their digests; None = none could be made) is
        still being computed, and the prompt is verified here against D's sequence the
        answer hands back, so neither the claim's round trip nor a second one for the
        prompt waits on tokenizing. The deadline counts from the prompt: what `wait_s`
        says for its token count (default: the base lookup deadline). An answer after the
        deadline goes to `answered_late` (the daemon claimed for it all the same).
        `request_id` is the turn's, which D's sidecar registers: a retention registered for it is
        not this lookup's to claim."""
        req = leases_pb2.LookupRequest(tenant=tenant, conversation_id=conversation_id, request_id=request_id)

        def made() -> tuple[int, bytes] | None:
            if not prompt.done() or prompt.cancelled() or prompt.exception() is not None:
                return None
            got = prompt.result()
            return None if got is None else (len(got[0]), got[1])

        def deadline_s() -> float:
            if wait_s is None:
                return self._s.lookup_deadline_s
            known = made()
            return wait_s(known[0] if known is not None else 0)

        now = time.monotonic()
        if not self.breaker.allows(now):
            return skipped(Skip.BACKOFF)
        replica = self.owners.replica(tenant, conversation_id) or self._replica
        try:
            res = await replica.stream.lookup_verifying(
                req,
                prompt,
                deadline_s,
                None if answered_late is None else lambda res: answered_late(reuse_of(answer_of(res))),
            )
        except LeaseOpError as e:
            return self._lookup_failed(replica, e, now, conversation_id)
        except Exception as e:  # a client-library surprise must not cost the turn
            self.breaker.record(False, time.monotonic())
            log.warning("router.lookup.crashed", address=replica.address, error=repr(e))
            return skipped(Skip.ERROR)
        self.breaker.record(True, time.monotonic())
        replica.late = 0
        return verified_reuse(answer_of(res), made())

    def _lookup_failed(
        self, replica: Replica, e: LeaseOpError, sent_at: float, conversation_id: str
    ) -> Reuse:
        """A lookup sent to `replica` at `sent_at` failed: count it against the replica
        (and the breaker), fail over when it looks gone or hung; -> the turn's reuse."""
        late = e.code is grpc.StatusCode.DEADLINE_EXCEEDED
        unreachable = e.code in _UNREACHABLE or e.stream_lost  # (a lost stream: whatever its status)
        if late and sent_at > replica.late_at:
            replica.late, replica.late_at = replica.late + 1, time.monotonic()
        elif not late:
            replica.late = 0
        owner = replica is not self._replica  # (an owner's: the others answer meanwhile)
        # (one late answer is no failing daemon: on a saturated machine answers are read
        # late, and a breaker opened by each would skip reuse for every turn meanwhile)
        if not owner and (unreachable or (late and replica.late >= LATE_TRIPS)):
            self.breaker.record(False, time.monotonic())
        # (a replica that keeps its connection but answers nothing in time: hung, or
        # overloaded, is left as one that cannot be reached is)
        failing_over = unreachable or replica.late >= LATE_FAILOVER
        if failing_over:
            replica.late, replica.late_at = 0, time.monotonic()  # (those still out: not counted)
            self._failover(replica)
            if owner:  # (its conversations go to the replica in use a while)
                self.owners.shun(replica.address)
        if failing_over or e.stream_lost:
            self._reopen()  # (the stream of the replica now used, set up before a turn needs it)
        log.info(
            "router.lookup.failed",
            address=replica.address,
            code=e.code.name,
            error=e.message,
            conversation_id=conversation_id,
        )
        return skipped(Skip.LATE if late else Skip.UNAVAILABLE if unreachable else Skip.ERROR)

    async def score(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading cached blocks of a prompt per prefill node ({} on any failure, or while
        the daemon is failing lookups: a turn does not wait for it to fail this too)."""
        if not self.breaker.allows(time.monotonic()):
            return {}
        replica = self._replica
        try:
            res = await replica.nodes.Score(
                nodes_pb2.ScoreRequest(block_hashes=hashes), timeout=self._s.score_deadline_s
            )
        except grpc.aio.AioRpcError as e:
            log.debug("router.score.failed", address=replica.address, code=e.code().name)
            return {}
        except Exception as e:
            log.warning("router.score.crashed", address=replica.address, error=repr(e))
            return {}
        return {s.engine_id: s.cached_blocks for s in res.scores}

    async def list_nodes(self) -> list[Listed] | None:
        """Every node the daemon knows, those whose liveness lapsed too (None: the daemon
        could not be asked)."""
        replica = self._replica
        try:
            res = await replica.nodes.List(
                nodes_pb2.ListNodesRequest(include_dead=True), timeout=self._s.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in _UNREACHABLE or e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                self._failover(replica)
            log.debug("router.nodes.list_failed", address=replica.address, code=e.code().name)
            return None
        return [Listed(node, n.alive, n.generation) for n in res.nodes if (node := node_of(n)) is not None]

    async def end_conversation(self, tenant: str, conversation_id: str) -> Ended:
        """Revoke the conversation's retention as its end (D's sidecar frees the blocks, or
        the answer carries the params to). Raises grpc.aio.AioRpcError."""
        replica = self._replica
        request = leases_pb2.RevokeLeaseRequest(
            tenant=tenant, conversation_id=conversation_id, conversation_end=True
        )
        try:
            res = await replica.leases.Revoke(request, timeout=self._s.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in _UNREACHABLE or e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                self._failover(replica)
            raise
        params = struct_to_dict(res.release_params) if res.HasField("release_params") else None
        return Ended(res.found, res.released_by_node, params, res.lease.engine_id)

    async def owed_answers(self, timeout_s: float) -> None:
        """Until the lookups answered after their turn gave up on them have had their answers
        (see LeaseStream.owed_answers), or `timeout_s`."""
        until = time.monotonic() + timeout_s
        for r in {*self._replicas, *self._retired, *self.owners.all()}:
            await r.stream.owed_answers(until - time.monotonic())

    async def close(self) -> None:
        await cancel_and_wait([self._reopening, *self._retiring, *self._opening])
        owned = [r for r in self.owners.forget() if r not in self._replicas]
        for r in [*self._replicas, *self._retired, *owned]:
            await r.close()
        self._retired.clear()

"""The workload whose history is checked: fake decode sidecars and clients talking to
daemon replicas (processes) through their public gRPC API only, everything recorded.

- Each fake sidecar registers its decode node and holds an Attach stream to one
  replica (heartbeats with a small KV pool, so the retention budget releases some
  retentions over it; releases recorded), moving to the next replica when its stream
  breaks or its heartbeats go unanswered. Its registration workers register a new
  retention (a unique id) for one of its conversations after another (now and then one
  of another D's), through any replica, by unary Register or on a Leases/Stream; one
  whose outcome is unknown is never sent again (as sidecar.retentions does). A quarter
  of them expire during the run. With `Shape.node_restarts_s`, it also registers its
  engine as a new process now and then, through any replica (recorded: Kind.NODE).
- Clients look the same few conversations of two tenants up at once, each op through a
  replica picked at random: unary Lookup (some with deadlines close to a claim's
  latency: the daemon puts back what the claim took), a Leases/Stream lookup whose
  prompt follows (late answers recorded as what they are), some for the request a
  retention was registered for (own_turn).
- A revoker ends or revokes conversations now and then.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.channels import daemon_channel_options
from kvferry.leaseclient import LeaseStream
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, leases_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from sidecar.releases import ReleasesSeen
from tests.factories import d_params, lease_request, node_request
from tests.history.checker import Kind, Op
from tests.history.recorder import Recorder, on_this_clock

TOKENS = 1000
"""Tokens each retention holds (63 blocks of 16); lookups ask for more: a PULL of all."""
LIFETIME_S = 300.0
"""A retention's lifetime, mostly: longer than the run."""
SHORT_LIFETIME_S = (11.0, 16.0)
"""The others': past the daemon's safety margin (10 s by default) within the run."""
CHANNEL_OPTIONS = daemon_channel_options(max_backoff_ms=1000)
"""The options of the router's channels to the daemon (keepalive pings, message limits): a
replica restarted is reached again within a second, not after gRPC's backoff."""
CALL_S = 3.0
"""Deadline of the calls that are not racing one."""
AttachCall = grpc.aio.StreamStreamCall[nodes_pb2.AttachRequest, nodes_pb2.AttachResponse]
HEARTBEAT_S = 1.0
ACK_WAIT_S = 3.0
"""A replica that answers no heartbeat this long is left for the next one."""


@dataclass(frozen=True)
class Shape:
    """How much of what the workload does."""

    engines: int = 2
    conversations: int = 4
    """Per tenant; each belongs to one engine."""
    tenants: tuple[str, ...] = ("t1", "t2")
    clients: int = 8
    registrars: int = 2
    """Registration workers per engine."""
    pool_blocks: int = 300
    """The KV pool each fake sidecar reports: the retention budget (half of it by default)
    holds fewer blocks than its conversations' retentions, so it releases some."""
    liveness_ttl_s: int = 5
    node_restarts_s: float = 0.0
    """Each fake sidecar registers its engine as a new process about this often (an engine
    restart: its retentions die; 0 = never)."""
    pause_s: float = 0.005
    """Between one client's ops (a busy client, not a flood: the machine has 2 cores)."""


@dataclass
class Shared:
    """What every actor of one run shares."""

    addresses: Sequence[str]
    recorder: Recorder
    shape: Shape
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    latest: dict[tuple[str, str], str] = field(default_factory=dict)
    """The last retention registered OK per (tenant, conversation): own_turn lookups."""
    ids: itertools.count[int] = field(default_factory=itertools.count)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    lookup_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=100))
    """How long the last lookups answered took."""

    def typical_lookup_s(self) -> float:
        """The median of `lookup_s` (10 ms before any)."""
        return statistics.median(self.lookup_s) if self.lookup_s else 0.01

    def keys(self, engine: int | None = None) -> list[tuple[str, str]]:
        """(tenant, conversation) pairs, those of one engine's when given."""
        convs = [f"c{i}" for i in range(self.shape.conversations) if engine in (None, i % self.shape.engines)]
        return [(t, c) for t in self.shape.tenants for c in convs]

    def pick(self, rng: random.Random) -> tuple[int, str]:
        i = rng.randrange(len(self.addresses))
        return i, self.addresses[i]

    def leases(self, i: int) -> leases_pb2_grpc.LeasesAsyncStub:
        return leases_pb2_grpc.LeasesStub(self.channels[i])


def engine_id(n: int) -> str:
    return f"d-{n}"


class FakeSidecar:
    """A decode node's sidecar: its node's registration and Attach stream, and the
    registrations of its conversations' retentions."""

    def __init__(self, shared: Shared, n: int) -> None:
        self.shared = shared
        self.n = n
        self.engine = engine_id(n)
        self.started_at = 1000.0 + n
        """When its engine process started (a restart moves it)."""
        self.attached = asyncio.Event()
        self.seen = ReleasesSeen()  # (the daemon tells a release at least once: as the real sidecar)
        self._streams = [LeaseStream(ch) for ch in shared.channels]

    async def close(self) -> None:
        for s in self._streams:
            await s.close()

    async def attach_forever(self) -> None:
        """Attached to one replica after another, each until its stream fails."""
        for i in itertools.cycle(range(len(self.shared.addresses))):
            i = (i + self.n) % len(self.shared.addresses)
            if self.shared.stopping.is_set():
                return
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await self._attached_to(i)
            self.attached.clear()
            await asyncio.sleep(0.1)

    async def _attached_to(self, i: int) -> None:
        channel = self.shared.channels[i]
        nodes = nodes_pb2_grpc.NodesStub(channel)
        generation = (await nodes.Register(self._node_request(True), timeout=CALL_S)).node.generation
        call: AttachCall = nodes.Attach(None)
        try:
            hello = nodes_pb2.AttachHello(engine_id=self.engine, generation=generation)
            await call.write(nodes_pb2.AttachRequest(hello=hello))
            beating = asyncio.create_task(self._heartbeats(call))
            try:
                await self._read(call, f"r{i}")
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await beating
        finally:
            call.cancel()

    async def _heartbeats(self, call: AttachCall) -> None:
        pool = self.shared.shape.pool_blocks
        for seq in itertools.count(1):
            await asyncio.sleep(HEARTBEAT_S)
            beat = nodes_pb2.Heartbeat(seq=seq, pool_blocks=pool, pool_usage=0.3)
            await call.write(nodes_pb2.AttachRequest(heartbeat=beat))

    async def _read(self, call: AttachCall, via: str) -> None:
        """Until the stream ends or goes quiet; releases recorded as they come."""
        while not self.shared.stopping.is_set():
            msg = await asyncio.wait_for(call.read(), ACK_WAIT_S + HEARTBEAT_S)
            if not isinstance(msg, nodes_pb2.AttachResponse):  # (EOF: the stream ended)
                return
            kind = msg.WhichOneof("body")
            if kind == "attached":
                self.attached.set()
            elif kind == "release" and self.seen.first(
                msg.release.conversation_id, struct_to_dict(msg.release.kv_transfer_params)
            ):
                self.shared.recorder.release(self.engine, msg.release, via)

    def _node_request(self, no_restart_seen: bool) -> nodes_pb2.RegisterNodeRequest:
        """Its engine's registration (`no_restart_seen`: the same process as before, or a new one)."""
        return node_request(
            self.engine,
            generation=0,
            liveness_ttl_seconds=self.shared.shape.liveness_ttl_s,
            engine_started_at=self.started_at,
            no_restart_seen=no_restart_seen,
        )

    async def restart_forever(self) -> None:
        """Register the engine as a new process now and then (its Attach stream then ends,
        and the sidecar attaches again to the new one's generation)."""
        rng = random.Random(f"{self.engine}/restarts")
        shared, every = self.shared, self.shared.shape.node_restarts_s
        while not shared.stopping.is_set():
            await asyncio.sleep(rng.uniform(0.5, 1.5) * every)
            self.started_at += 1.0
            req = self._node_request(no_restart_seen=False)
            i, _ = shared.pick(rng)
            t0 = shared.recorder.start()
            try:
                res = await nodes_pb2_grpc.NodesStub(shared.channels[i]).Register(req, timeout=CALL_S)
            except grpc.aio.AioRpcError as e:
                shared.recorder.failed(
                    Kind.NODE, f"{self.engine}/restart", ("", ""), t0, e, f"r{i}", engine=self.engine
                )
                continue
            shared.recorder.node(f"{self.engine}/restart", self.engine, t0, res, f"r{i}")

    async def register_forever(self, worker: int) -> None:
        """Register a new retention for one of the engine's conversations after another."""
        rng = random.Random(f"{self.engine}/{worker}")
        home, every = self.shared.keys(self.n), self.shared.keys()
        while not self.shared.stopping.is_set():
            # a conversation's turns mostly end on its own D; some on another (replacing
            # the first D's retention: its release, if any, is handed to this sidecar)
            await self.register(rng.choice(home if rng.random() < 0.8 else every), rng)
            await asyncio.sleep(rng.uniform(0.0, 4 * self.shared.shape.pause_s))

    async def register(self, key: tuple[str, str], rng: random.Random) -> None:
        shared, process = self.shared, f"{self.engine}/reg"
        x = f"{self.engine}-{key[0]}-{key[1]}-{next(shared.ids)}"
        # a quarter expire during the run: into the safety margin, then past the deadline
        lifetime = rng.uniform(*SHORT_LIFETIME_S) if rng.random() < 0.25 else LIFETIME_S
        deadline = time.time() + lifetime
        req = lease_request(key[1], self.engine, TOKENS, key[0], params=d_params(self.engine, TOKENS, x))
        req.expires_at.FromNanoseconds(int(deadline * 1e9))
        req.request_id = x
        i, _ = shared.pick(rng)
        expires = on_this_clock(deadline)
        t0 = shared.recorder.start()
        try:
            if rng.random() < 0.5:
                res = await shared.leases(i).Register(req, timeout=CALL_S)
            else:
                res = await self._streams[i].register(req, CALL_S)
        except Exception as e:  # recorded: its outcome is the history's
            shared.recorder.failed(
                Kind.REGISTER, process, key, t0, e, f"r{i}", retention=x, expires=expires, engine=self.engine
            )
            return
        shared.recorder.register(process, key, t0, x, res, f"r{i}", expires, self.engine)
        shared.latest[key] = x


class Client:
    """A router-like client looking conversations up through every replica."""

    def __init__(self, shared: Shared, n: int) -> None:
        self.shared = shared
        self.name = f"client{n}"
        self.rng = random.Random(self.name)
        self._streams = [LeaseStream(ch) for ch in shared.channels]

    async def close(self) -> None:
        for s in self._streams:
            await s.owed_answers(2.0)
            await s.close()

    async def run(self) -> None:
        keys = self.shared.keys()
        while not self.shared.stopping.is_set():
            key = self.rng.choice(keys)
            req = leases_pb2.LookupRequest(tenant=key[0], conversation_id=key[1], prompt_tokens=2 * TOKENS)
            if self.rng.random() < 0.1:
                req.request_id = self.shared.latest.get(key, "")  # its own turn's, maybe
            i, _ = self.shared.pick(self.rng)
            if self.rng.random() < 0.5:
                await self._unary(i, key, req)
            else:
                await self._streamed(i, key, req)
            await asyncio.sleep(self.rng.uniform(0.0, 2 * self.shared.shape.pause_s))

    def _deadline(self) -> float:
        """A quarter of the lookups race a deadline about as long as a lookup takes now
        (0.3 to 1.5 times the median of the last ones answered): some are answered, some
        cancelled at the daemon mid-claim (it puts back what it took), whatever a claim
        costs on this machine and in this daemon."""
        if self.rng.random() >= 0.25:
            return CALL_S
        return max(self.shared.typical_lookup_s() * self.rng.uniform(0.3, 1.5), 0.001)

    def _answered(self, op: Op) -> None:
        self.shared.lookup_s.append(op.completed - op.invoked)

    async def _unary(self, i: int, key: tuple[str, str], req: leases_pb2.LookupRequest) -> None:
        rec = self.shared.recorder
        t0 = rec.start()
        try:
            res = await self.shared.leases(i).Lookup(req, timeout=self._deadline())
        except grpc.aio.AioRpcError as e:
            rec.failed(Kind.LOOKUP, self.name, key, t0, e, f"r{i}")
            return
        self._answered(rec.lookup(self.name, key, t0, res, f"r{i}"))

    async def _streamed(self, i: int, key: tuple[str, str], req: leases_pb2.LookupRequest) -> None:
        """A lookup whose prompt follows a moment later (half of them with caller_verifies,
        as the router sends them: the claim leaves with no prompt); an answer after its
        deadline is recorded when it comes (the daemon claimed for it: the router releases it)."""
        rec, rng = self.shared.recorder, self.rng
        tokens = req.prompt_tokens
        t0 = rec.start()
        unknown: list[Op] = []  # what was recorded when the deadline passed

        async def prompt() -> leases_pb2.LookupPrompt:
            await asyncio.sleep(rng.uniform(0.0, 0.005))  # (tokenizing, digesting)
            return leases_pb2.LookupPrompt(prompt_tokens=tokens)

        def late(res: leases_pb2.LookupResponse) -> None:
            if unknown:  # (it always is: a late answer comes after the caller gave up)
                rec.supersede(unknown[0])
            rec.lookup(self.name, key, t0, res, f"r{i} late", late=True)

        stream = self._streams[i]
        try:
            if rng.random() < 0.5:  # the router's way: the answer's check is verified here
                req.ClearField("prompt_tokens")
                res = await stream.lookup_verifying(req, prompt(), self._deadline(), late)
            else:
                res = await stream.lookup_with_prompt(req, prompt(), self._deadline(), late)
        except Exception as e:  # recorded: its outcome is the history's
            unknown.append(rec.failed(Kind.LOOKUP, self.name, key, t0, e, f"r{i}"))
            return
        self._answered(rec.lookup(self.name, key, t0, res, f"r{i}"))


async def revoke_forever(shared: Shared) -> None:
    """End (or just revoke) a conversation now and then, through any replica."""
    rng = random.Random("revoker")
    keys = shared.keys()
    while not shared.stopping.is_set():
        await asyncio.sleep(rng.uniform(0.05, 0.3))
        key = rng.choice(keys)
        i, _ = shared.pick(rng)
        req = leases_pb2.RevokeLeaseRequest(
            tenant=key[0], conversation_id=key[1], conversation_end=rng.random() < 0.7
        )
        t0 = shared.recorder.start()
        try:
            res = await shared.leases(i).Revoke(req, timeout=CALL_S)
        except grpc.aio.AioRpcError as e:
            shared.recorder.failed(Kind.REVOKE, "revoker", key, t0, e, f"r{i}")
            continue
        shared.recorder.revoke("revoker", key, t0, res, f"r{i}")


@contextlib.asynccontextmanager
async def running(
    addresses: Sequence[str], shape: Shape = Shape(), recorder: Recorder | None = None
) -> AsyncIterator[Shared]:
    """The workload against `addresses`, from when every fake sidecar is attached until
    the block exits (then every actor stops and every answer owed has come or timed out)."""
    shared = Shared(addresses, recorder or Recorder(), shape)
    shared.channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
    sidecars = [FakeSidecar(shared, n) for n in range(shape.engines)]
    clients = [Client(shared, n) for n in range(shape.clients)]
    attaching = [asyncio.create_task(s.attach_forever()) for s in sidecars]
    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*(s.attached.wait() for s in sidecars))
        tasks += [
            asyncio.create_task(s.register_forever(w)) for s in sidecars for w in range(shape.registrars)
        ]
        tasks += [asyncio.create_task(c.run()) for c in clients]
        if shape.node_restarts_s:
            tasks += [asyncio.create_task(s.restart_forever()) for s in sidecars]
        tasks.append(asyncio.create_task(revoke_forever(shared)))
        yield shared
    finally:
        shared.stopping.set()
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.close()
            for s in sidecars:
                await s.close()
            for t in attaching:  # (the releases owed came over it meanwhile)
                t.cancel()
            await asyncio.gather(*attaching, return_exceptions=True)
            for ch in shared.channels:
                await ch.close(None)

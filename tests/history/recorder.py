"""The recording half of the history check: every call the workload makes to a daemon
replica, timed on one clock (time.monotonic()) and turned into a checker `Op` with its
outcome: OK with what the answer handed out or took, FAILED for a refusal that proves
nothing was done, UNKNOWN for everything else (a deadline, a lost connection, a stream
that broke: it may have taken effect).

Retentions are named by D's ``remote_request_id`` in their params, unique per
registration (the workload's `retention_id`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from kvferry.leaseclient import LeaseOpError
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, nodes_pb2
from tests.history.checker import Kind, Op, Status

DEFINITE = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.ABORTED,
    }
)
"""Refusals that prove the daemon did nothing (validation, a node not registered...;
ABORTED: turned away undecided while etcd or the shard's owner could not take it, which
the rule `unregistered` checks: one applied after all would be handed out unregistered)."""


def retention_of(params: struct_pb2.Struct) -> str:
    """The retention a Struct of D's params names ("" = none)."""
    return str(struct_to_dict(params).get("remote_request_id", "")) if params.fields else ""


def on_this_clock(wall: float) -> float:
    """A wall-clock time (a retention's deadline) as a time.monotonic() one."""
    return wall - time.time() + time.monotonic()


def status_of(e: BaseException) -> tuple[Status, str]:
    """A failed call's outcome, and its code's name."""
    if isinstance(e, LeaseOpError):
        if not e.sent:
            return Status.FAILED, f"{e.code.name} unsent"
        return (Status.FAILED if e.code in DEFINITE else Status.UNKNOWN), e.code.name
    if isinstance(e, grpc.aio.AioRpcError):
        return (Status.FAILED if e.code() in DEFINITE else Status.UNKNOWN), e.code().name
    return Status.UNKNOWN, type(e).__name__


@dataclass
class Recorder:
    """The history of one run: ops in the order their outcomes were known."""

    ops: list[Op] = field(default_factory=list)
    """Append-only (see `history`)."""
    replicas: dict[int, str] = field(default_factory=dict)
    """The replica (by index) each op went to, by id(op): for the excerpts."""
    superseded: set[int] = field(default_factory=set)
    """id() of UNKNOWN ops whose answer came after all (recorded again, OK)."""
    _added: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> float:
        """The invocation time of an op about to be sent."""
        return time.monotonic()

    def add(self, op: Op, via: str = "") -> Op:
        self.ops.append(op)
        if via:
            self.replicas[id(op)] = via
        self._added.set()
        return op

    def supersede(self, op: Op) -> None:
        """`op` (UNKNOWN) got its answer late: that answer is recorded instead."""
        self.superseded.add(id(op))

    def history(self) -> list[Op]:
        """The ops to check."""
        return [o for o in self.ops if id(o) not in self.superseded]

    async def until(self, what: Callable[[Op], bool], count: int, after: float) -> None:
        """Until `count` ops invoked after `after` match `what`."""
        seen, matched = 0, 0
        while True:
            new, seen = self.ops[seen:], len(self.ops)
            matched += sum(o.invoked > after and what(o) for o in new)
            if matched >= count:
                return
            self._added.clear()
            await self._added.wait()

    def failed(
        self,
        kind: Kind,
        process: str,
        key: tuple[str, str],
        t0: float,
        e: BaseException,
        via: str = "",
        **kw: Any,
    ) -> Op:
        """Record a call that raised `e`. -> the op."""
        status, code = status_of(e)
        return self.add(Op(process, kind, *key, t0, time.monotonic(), status, detail=code, **kw), via)

    def lookup(
        self,
        process: str,
        key: tuple[str, str],
        t0: float,
        res: leases_pb2.LookupResponse,
        via: str = "",
        late: bool = False,
    ) -> Op:
        """Record a lookup's answer: PULL params or release params hand their retention
        out (and the claim took it); `late`: after its caller gave up."""
        params = res.kv_transfer_params if res.decision == leases_pb2.PULL else res.release_params
        x = retention_of(params)
        op = Op(process, Kind.LOOKUP, *key, t0, time.monotonic(), Status.OK, handed=x, retired=x, late=late)
        return self.add(replace(op, detail=res.reason), via)

    def register(
        self,
        process: str,
        key: tuple[str, str],
        t0: float,
        x: str,
        res: leases_pb2.RegisterLeaseResponse,
        via: str = "",
        expires: float = math.inf,
        engine: str = "",
    ) -> Op:
        """Record a registration's answer: release params hand the replaced retention out.
        (`expires`: the deadline it asked for, on this clock: see `on_this_clock`; `engine`:
        the engine it was registered on.)"""
        released = retention_of(res.release_params)
        detail = "replaced" if res.replaced else "new"
        now = time.monotonic()
        op = Op(process, Kind.REGISTER, *key, t0, now, Status.OK, x, released, released, detail, expires)
        return self.add(replace(op, engine=engine), via)

    def node(self, process: str, engine: str, t0: float, res: nodes_pb2.RegisterNodeResponse, via: str) -> Op:
        """Record an engine's registration as a new process (an engine restart)."""
        detail = f"generation {res.node.generation}"
        return self.add(
            Op(process, Kind.NODE, "", "", t0, time.monotonic(), Status.OK, detail=detail, engine=engine), via
        )

    def revoke(
        self,
        process: str,
        key: tuple[str, str],
        t0: float,
        res: leases_pb2.RevokeLeaseResponse,
        via: str = "",
    ) -> Op:
        """Record a revoke's answer: it took what it found; its release params hand that out
        (released_by_node: the sidecar gets it over Attach, recorded there)."""
        found = retention_of(res.lease.kv_transfer_params) if res.found else ""
        detail = "released_by_node" if res.released_by_node else "found" if res.found else "not_found"
        handed = retention_of(res.release_params)
        op = Op(process, Kind.REVOKE, *key, t0, time.monotonic(), Status.OK, "", handed, found, detail)
        return self.add(op, via)

    def release(self, process: str, msg: nodes_pb2.ReleaseRetention, via: str = "") -> Op:
        """Record a ReleaseRetention a sidecar got: it hands the retention out; a budget's
        (or an idle) release also took it, a conversation's end's was taken by its revoke."""
        now = time.monotonic()
        x = retention_of(msg.kv_transfer_params)
        took = "" if msg.reason == "conversation_end" else x
        key = (msg.tenant, msg.conversation_id)
        op = Op(process, Kind.RELEASE, *key, now, now, Status.OK, "", x, took, msg.reason)
        return self.add(op, via)

    def save(self, path: Path) -> Path:
        """The history (with each op's replica) as JSON lines at `path`, to look into."""
        with path.open("w") as out:
            for o in self.history():
                fields = {k: v for k, v in dataclasses.asdict(o).items() if v != math.inf}
                out.write(json.dumps({**fields, "via": self.replicas.get(id(o), "")}) + "\n")
        return path

    def excerpt_lines(self, ops: tuple[Op, ...]) -> list[str]:
        """`ops` as the checker prints them, each with the replica it went to."""
        return [f"{o.line()} via={self.replicas.get(id(o), '?')}" for o in ops]

"""What the fault suite records of the retentions: every registration a sidecar sent
and its outcome, every retention a lookup was granted (on time or late), and every
release a daemon had D's sidecar make, keyed by D's request id (``remote_request_id``:
one retention per D answer).

It taps ``kvferry.leaseclient.LeaseStream``, the one path the sidecars' registrations
and the router's lookups take to the daemon, and ``sidecar.node.NodeSession._release``,
where a sidecar gets a daemon's ReleaseRetention, in this process only; the daemons run
elsewhere and are not touched."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvferry.leaseclient import LeaseOpError, LeaseStream
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, nodes_pb2
from sidecar.node import NodeSession


@dataclass(frozen=True)
class Grant:
    """A retention a lookup got: to pull (`pull`) or only to release."""

    at: float
    conversation_id: str
    retention: str
    blocks: tuple[int, ...]
    pull: bool
    late: bool


@dataclass(frozen=True)
class Registration:
    """One try to register a retention: `outcome` "ok" or the status's name."""

    at: float
    conversation_id: str
    retention: str
    outcome: str
    sent: bool = True
    replaced: str = ""
    """The unclaimed retention this one replaced ("" = none), per the daemon's answer."""


@dataclass(frozen=True)
class Released:
    """A retention a daemon had D's sidecar free (its budget, an orphaned put-back, ...)."""

    at: float
    conversation_id: str
    retention: str
    reason: str


@dataclass
class Ledger:
    grants: list[Grant] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)
    releases: list[Released] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Record through LeaseStream.register, .lookup_with_prompt and .lookup_verifying,
        and NodeSession._release (until the test ends)."""
        register = LeaseStream.register
        release = NodeSession._release
        ledger = self

        async def tapped_register(
            stream: LeaseStream, req: leases_pb2.RegisterLeaseRequest, deadline_s: float
        ) -> leases_pb2.RegisterLeaseResponse:
            retention = str(struct_to_dict(req.kv_transfer_params).get("remote_request_id", ""))
            cid = req.conversation_id
            try:
                res = await register(stream, req, deadline_s)
            except LeaseOpError as e:
                ledger.registrations.append(
                    Registration(time.monotonic(), cid, retention, e.code.name, e.sent)
                )
                raise
            replaced = ""
            if res.HasField("release_params"):
                replaced = str(struct_to_dict(res.release_params).get("remote_request_id", ""))
            ledger.registrations.append(Registration(time.monotonic(), cid, retention, "ok", True, replaced))
            return res

        def tapped_lookup(lookup: Callable[..., Awaitable[leases_pb2.LookupResponse]]) -> Any:
            async def tapped(
                stream: LeaseStream,
                req: leases_pb2.LookupRequest,
                ready: Awaitable[Any],
                deadline_s: float | Callable[[], float],
                late: Callable[[leases_pb2.LookupResponse], None] | None = None,
            ) -> leases_pb2.LookupResponse:
                cid = req.conversation_id

                def late_answer(res: leases_pb2.LookupResponse) -> None:
                    ledger.granted(cid, res, late=True)
                    if late is not None:
                        late(res)

                res = await lookup(stream, req, ready, deadline_s, late_answer)
                ledger.granted(cid, res, late=False)
                return res

            return tapped

        def tapped_release(session: NodeSession, msg: nodes_pb2.ReleaseRetention) -> None:
            retention = str(struct_to_dict(msg.kv_transfer_params).get("remote_request_id", ""))
            ledger.releases.append(Released(time.monotonic(), msg.conversation_id, retention, msg.reason))
            release(session, msg)

        monkeypatch.setattr(LeaseStream, "register", tapped_register)
        monkeypatch.setattr(NodeSession, "_release", tapped_release)
        for name in ("lookup_with_prompt", "lookup_verifying"):  # (the router's two ways)
            monkeypatch.setattr(LeaseStream, name, tapped_lookup(getattr(LeaseStream, name)))

    def granted(self, conversation_id: str, res: leases_pb2.LookupResponse, late: bool) -> None:
        """Note the retention a lookup answer hands out (to pull, or to release), if any."""
        pull = res.decision == leases_pb2.PULL
        params = struct_to_dict(res.kv_transfer_params if pull else res.release_params)
        retention = str(params.get("remote_request_id", ""))
        if retention:
            blocks = tuple(_flat(params.get("remote_block_ids") or ()))
            self.grants.append(Grant(time.monotonic(), conversation_id, retention, blocks, pull, late))

    def double_claims(self) -> list[str]:
        """Retentions handed out more than once."""
        seen: dict[str, int] = {}
        for g in self.grants:
            seen[g.retention] = seen.get(g.retention, 0) + 1
        return sorted(r for r, n in seen.items() if n > 1)


def _flat(ids: Any) -> list[int]:
    """Block ids, flat (vLLM's may be one list per KV-cache group)."""
    if isinstance(ids, list | tuple):
        return [b for i in ids for b in _flat(i)]
    return [int(ids)]

"""The Leases servicer (the API's name for retentions): each RPC translates its message
(controlplane.messages), calls one domain operation, and builds the reply; errors become
statuses in server/status.py. Leases/Stream runs the same ops in server/stream.py."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import grpc

from controlplane.convert import apply_handout
from controlplane.errors import FailedPrecondition, InvalidArgument
from controlplane.messages import (
    fill_lookup_response,
    lease_message,
    lookup_query_of,
    prompt_of,
    retention_registration_of,
)
from controlplane.owners import OwnedRetentions
from controlplane.policy import RELEASE, Prompt
from controlplane.records import OwnerRecord
from controlplane.server.auth import allowed, caller, require
from controlplane.server.status import rpc
from controlplane.server.stream import Later, OpStream
from controlplane.service.held import HeldPins, Pin, PinState
from controlplane.service.lookups import Lookups
from controlplane.service.retentions import Retentions
from kvferry.security.roles import (
    all_tenants_denial,
    node_denial,
    revoke_denial,
    stream_op_denial,
    tenant_denial,
)
from kvferry.shards import DEFAULT_TENANT
from kvferry.v1 import leases_pb2, leases_pb2_grpc

_LEASES = "/kvferry.v1.Leases/"
_PIN_STATES = {
    PinState.RETAINED: leases_pb2.PIN_RETAINED,
    PinState.CLAIMED: leases_pb2.PIN_CLAIMED,
    PinState.SETTLED: leases_pb2.PIN_SETTLED,
    PinState.ORPHAN: leases_pb2.PIN_ORPHAN,
}


def _check_tenant(tenant: str, method: str) -> None:
    """The caller may see and use `tenant`'s retentions ("" = the default tenant)."""
    require(tenant_denial(caller(), tenant or DEFAULT_TENANT), _LEASES + method)


def _may_look_up(request: leases_pb2.LookupRequest) -> None:
    """The caller may send lookups, for the request's tenant (else PermissionDenied)."""
    require(stream_op_denial(caller(), "lookup"), _LEASES + "Lookup")
    _check_tenant(request.tenant, "Lookup")


class LeasesServicer(leases_pb2_grpc.LeasesServicer):
    """kvferry.v1.Leases."""

    def __init__(
        self,
        retentions: Retentions,
        lookups: Lookups,
        held: HeldPins | None = None,
        owned: OwnedRetentions | None = None,
    ) -> None:
        """`held` answers Leases/Held, `owned` Leases/Routes (None: FAILED_PRECONDITION)."""
        self._retentions = retentions
        self._lookups = lookups
        self._held = held
        self._owned = owned

    async def _register(self, request: leases_pb2.RegisterLeaseRequest) -> leases_pb2.RegisterLeaseResponse:
        # A retention of engine E comes only from E's sidecar (or an admin): no one else's
        # blocks can be handed out for a conversation (the KV-poisoning attack).
        who = caller()
        require(
            stream_op_denial(who, "register") or node_denial(who, request.engine_id), _LEASES + "Register"
        )
        view, replaced, release = await self._retentions.register(retention_registration_of(request))
        # The stored retention without its params and digests: the caller just sent them.
        resp = leases_pb2.RegisterLeaseResponse(lease=lease_message(view, summary=True), replaced=replaced)
        if release is not None:
            apply_handout(release, RELEASE, resp.release_params)
        return resp

    async def _lookup(
        self,
        request: leases_pb2.LookupRequest,
        resp: leases_pb2.LookupResponse | None = None,
        later: Later | None = None,
    ) -> leases_pb2.LookupResponse:
        """Answer a lookup into `resp` (a new message if None); `later` brings the prompt
        of a lookup sent with prompt_follows."""
        _may_look_up(request)
        if request.prompt_follows and later is None:
            raise InvalidArgument("prompt_follows needs Leases/Stream (the prompt comes in a later op)")
        result = await self._lookups.lookup(
            lookup_query_of(request), None if later is None else functools.partial(_prompt, later)
        )
        if resp is None:
            resp = leases_pb2.LookupResponse()
        fill_lookup_response(result, request.peek, resp)
        return resp

    def _lookup_now(self, request: leases_pb2.LookupRequest, resp: leases_pb2.LookupResponse) -> bool:
        """Answer a lookup into `resp` without awaiting anything (Lookups.lookup_now), or
        return False having done nothing (then `_lookup`)."""
        _may_look_up(request)
        if request.prompt_follows:
            return False
        result = self._lookups.lookup_now(lookup_query_of(request))
        if result is None:
            return False
        fill_lookup_response(result, request.peek, resp)
        return True

    @rpc("Leases/Register")
    async def Register(
        self, request: leases_pb2.RegisterLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.RegisterLeaseResponse:
        """Record a retention, replacing the conversation's previous one."""
        return await self._register(request)

    @rpc("Leases/Lookup")
    async def Lookup(
        self, request: leases_pb2.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.LookupResponse:
        """PULL or RECOMPUTE for a prompt; claims the retention unless peek."""
        return await self._lookup(request)

    def Stream(  # type: ignore[override]  # (yields the batches encoded: see its docstring)
        self,
        request_iterator: AsyncIterator[leases_pb2.LeaseOpBatch],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        """Register and Lookup ops on one stream, answered in completion order (stream.py):
        LeaseOpResultBatch messages, encoded already (the DecodeGuard passes them on)."""
        return self.op_stream().serve(request_iterator, context)

    def op_stream(self) -> OpStream:
        """A new Leases/Stream's ops and results (gRPC's, or a framed one's: server/framed.py)."""
        return OpStream(self._register, self._lookup, self._lookup_now)

    @rpc("Leases/Get")
    async def Get(
        self, request: leases_pb2.GetLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.Lease:
        """The conversation's retention, or what the marker of the claim that took it knows."""
        _check_tenant(request.tenant, "Get")
        return lease_message(await self._retentions.get(request.tenant, request.conversation_id))

    @rpc("Leases/List")
    async def List(
        self, request: leases_pb2.ListLeasesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.ListLeasesResponse:
        """A page of retentions."""
        if request.all_tenants:
            require(all_tenants_denial(caller()), _LEASES + "List")
        else:
            _check_tenant(request.tenant, "List")
        views, token = await self._retentions.list(
            request.tenant,
            request.all_tenants,
            request.engine_id,
            request.include_inactive,
            request.page_size,
            request.page_token,
        )
        return leases_pb2.ListLeasesResponse(leases=[lease_message(v) for v in views], next_page_token=token)

    @rpc("Leases/Revoke")
    async def Revoke(
        self, request: leases_pb2.RevokeLeaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.RevokeLeaseResponse:
        """Delete a retention so it is never handed out, with the params that free D's blocks
        (or, as a conversation's end, D's sidecar told to free them)."""
        tenant = request.tenant or DEFAULT_TENANT
        require(revoke_denial(caller(), tenant, request.conversation_end), _LEASES + "Revoke")
        told = False
        if request.conversation_end:
            view, releasable, told = await self._retentions.end(request.tenant, request.conversation_id)
        else:
            view, releasable = await self._retentions.revoke(request.tenant, request.conversation_id)
        allowed(
            _LEASES + "Revoke",
            tenant=request.tenant,
            conversation_id=request.conversation_id,
            found=view is not None,
            conversation_end=request.conversation_end,
        )
        if view is None:
            return leases_pb2.RevokeLeaseResponse(found=False)
        resp = leases_pb2.RevokeLeaseResponse(found=True, lease=lease_message(view), released_by_node=told)
        if releasable and view.retention is not None and not told:
            apply_handout(view.retention.params, RELEASE, resp.release_params)
        return resp

    @rpc("Leases/Held")
    async def Held(
        self, request: leases_pb2.HeldRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.HeldResponse:
        """What became of the D requests a decode node's sidecar holds pinned (held.py)."""
        # Only a node's own sidecar (or an admin) learns of its pins: what a claim marker
        # says of a conversation is no other node's business.
        require(node_denial(caller(), request.engine_id), _LEASES + "Held")
        if self._held is None:
            raise FailedPrecondition("Leases/Held is not served by this daemon")
        pins = [Pin(p.tenant, p.conversation_id, p.request_id, p.remote_request_id) for p in request.pins]
        states = await self._held.states(pins)
        return leases_pb2.HeldResponse(states=[_PIN_STATES[s] for s in states])

    @rpc("Leases/Routes")
    async def Routes(
        self, request: leases_pb2.RoutesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> leases_pb2.RoutesResponse:
        """Which replica decides each conversation's lookups (the owners of the claim shards)."""
        if self._owned is None:
            raise FailedPrecondition("Leases/Routes is not served by this daemon")
        return routes_message(self._owned.owners.settings.shards, await self._owned.routes())


def routes_message(shards: int, owners: dict[int, OwnerRecord]) -> leases_pb2.RoutesResponse:
    """The shards' owners as Leases/Routes answers them (owners without an address left out:
    nobody can send them anything)."""
    res = leases_pb2.RoutesResponse(shards=shards)
    by_replica: dict[str, leases_pb2.ShardOwner] = {}
    for shard, owner in sorted(owners.items()):
        if not owner.address:
            continue
        out = by_replica.get(owner.replica)
        if out is None:
            out = by_replica[owner.replica] = res.owners.add(
                replica=owner.replica, address=owner.address, stream_address=owner.stream_address
            )
        out.shards.append(shard)
    return res


async def _prompt(later: Later) -> Prompt:
    return prompt_of(await later)

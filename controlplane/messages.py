"""kvferry.v1 messages <-> the daemon's plain data: one mapping per direction, each in one
place (the servicers, the peers' answers and the stream all go through these)."""

from __future__ import annotations

from typing import Any

from google.protobuf import timestamp_pb2

from controlplane.attached import AttachedCounts, Beat
from controlplane.budget import Pool
from controlplane.convert import apply_handout
from controlplane.policy import RELEASE, Prompt
from controlplane.records import NodeRecord
from controlplane.service.budgets import Release
from controlplane.service.lookups import LookupQuery, LookupResult
from controlplane.service.nodes import ListedNode, NodeRegistration
from controlplane.service.retentions import RetentionRegistration, RetentionView
from controlplane.service.validation import role_of
from kvferry.structs import struct_to_dict
from kvferry.v1 import leases_pb2, nodes_pb2


def timestamp(t: float) -> timestamp_pb2.Timestamp:
    """Unix seconds as a protobuf Timestamp."""
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def seconds(msg: Any, field: str) -> float | None:
    """A Timestamp field of `msg` as Unix seconds (None: not set)."""
    if not msg.HasField(field):
        return None
    ts: timestamp_pb2.Timestamp = getattr(msg, field)
    return float(ts.seconds + ts.nanos / 1e9)


# -- nodes ---------------------------------------------------------------------


def registration_of(m: nodes_pb2.RegisterNodeRequest) -> NodeRegistration:
    """A Nodes/Register request as the domain takes it."""
    record = NodeRecord(
        engine_id=m.engine_id,
        role=role_of(m.role),
        model=m.model,
        block_size=m.block_size,
        http_url=m.http_url,
        side_channel_host=m.side_channel_host,
        side_channel_port=m.side_channel_port,
        generation=m.generation,
        registered_at=0.0,
        liveness_ttl=m.liveness_ttl_seconds,
        engine_url=m.engine_url,
        engine_started_at=m.engine_started_at,
    )
    return NodeRegistration(record, no_restart_seen=m.no_restart_seen)


def node_message(n: ListedNode) -> nodes_pb2.Node:
    """A node as the API reports it."""
    r, counts = n.state.record, n.counts
    return nodes_pb2.Node(
        engine_id=r.engine_id,
        role=int(r.role),  # type: ignore[arg-type]
        model=r.model,
        block_size=r.block_size,
        http_url=r.http_url,
        side_channel_host=r.side_channel_host,
        side_channel_port=r.side_channel_port,
        generation=r.generation,
        alive=n.state.alive,
        registered_at=timestamp(r.registered_at),
        live_leases=n.held[0],
        held_tokens=n.held[1],
        indexed_blocks=counts.indexed_blocks,
        engine_url=r.engine_url,
        suspended=bool(r.suspended_at),
        uncaptured_turns=counts.uncaptured_turns,
        unretained_blocks=counts.unretained_blocks,
        pool_blocks=counts.pool_blocks,
        pool_usage=counts.pool_usage,
        retained_blocks=counts.retained_blocks,
    )


def counts_of(m: nodes_pb2.Node) -> AttachedCounts:
    """A node's sidecar counts as another replica reported them."""
    return AttachedCounts(
        m.indexed_blocks,
        m.uncaptured_turns,
        m.unretained_blocks,
        m.pool_blocks,
        m.pool_usage,
        m.retained_blocks,
    )


def beat_of(m: nodes_pb2.Heartbeat) -> Beat:
    """A heartbeat's report as the domain takes it (a usage outside 0..1 is clamped)."""
    usage = m.pool_usage if m.pool_usage == m.pool_usage else 0.0  # (NaN: unknown)
    return Beat(m.uncaptured_turns, m.unretained_blocks, Pool(m.pool_blocks, min(max(usage, 0.0), 1.0)))


def release_message(r: Release) -> nodes_pb2.AttachResponse:
    """A release for D's sidecar on its Attach stream."""
    msg = nodes_pb2.ReleaseRetention(
        tenant=r.tenant, conversation_id=r.conversation_id, reason=r.reason.value
    )
    apply_handout(r.params, RELEASE, msg.kv_transfer_params)
    return nodes_pb2.AttachResponse(release=msg)


# -- retentions ----------------------------------------------------------------


def retention_registration_of(m: leases_pb2.RegisterLeaseRequest) -> RetentionRegistration:
    """A Leases/Register request as the domain takes it."""
    return RetentionRegistration(
        tenant=m.tenant,
        conversation_id=m.conversation_id,
        engine_id=m.engine_id,
        params=struct_to_dict(m.kv_transfer_params),
        params_blob=m.kv_transfer_params.SerializeToString(deterministic=True),
        num_tokens=m.num_tokens,
        expires_at=seconds(m, "expires_at"),
        block_size=m.block_size,
        digests=m.block_digests,
        generation=m.generation,
        request_id=m.request_id,
    )


def lease_message(v: RetentionView, summary: bool = False) -> leases_pb2.Lease:
    """A retention as the API reports it (a Lease); `summary`: without its params and
    digests. A claimed one shows what its claim marker knows."""
    m = leases_pb2.Lease(tenant=v.tenant, conversation_id=v.conversation_id, revision=v.revision)
    r = v.retention
    if r is not None:
        m.engine_id = r.engine_id
        m.generation = r.generation
        if not summary:
            m.kv_transfer_params.ParseFromString(r.params)
            m.block_digests = r.digests
        m.num_tokens = r.num_tokens
        m.block_size = r.block_size
        m.created_at.CopyFrom(timestamp(r.created_at))
        m.expires_at.CopyFrom(timestamp(r.expires_at))
        m.request_id = r.request_id
    c = v.claim
    if c is not None:
        m.claimed = True
        m.claimed_at.CopyFrom(timestamp(c.claimed_at))
        if r is None:  # (what the marker knows of the retention it took)
            m.engine_id, m.request_id = c.engine_id, c.claimed_by
            if c.expires_at:
                m.expires_at.CopyFrom(timestamp(c.expires_at))
    return m


def lookup_query_of(m: leases_pb2.LookupRequest) -> LookupQuery:
    """A Lookup request as the domain takes it."""
    return LookupQuery(
        tenant=m.tenant,
        conversation_id=m.conversation_id,
        prompt_tokens=m.prompt_tokens,
        prompt_digests=_digests_given(m),
        peek=m.peek,
        request_id=m.request_id,
        caller_verifies=m.caller_verifies,
    )


def prompt_of(m: leases_pb2.LookupPrompt) -> Prompt:
    """The prompt a prompt_follows lookup was sent."""
    return Prompt(m.prompt_tokens, _digests_given(m))


def _digests_given(m: leases_pb2.LookupRequest | leases_pb2.LookupPrompt) -> bytes | None:
    """A lookup's prompt_digests, None when not given (an empty set is given: see Prompt)."""
    return m.prompt_digests if m.HasField("prompt_digests") else None


def fill_lookup_response(result: LookupResult, peek: bool, out: leases_pb2.LookupResponse) -> None:
    """A lookup's answer into `out`: the decision, and the params it hands out (none for a
    peek, which hands nothing out: params forwarded would be read twice)."""
    d = result.decision
    out.decision = leases_pb2.PULL if d.pull else leases_pb2.RECOMPUTE
    out.reason = d.reason.value
    out.detail = d.detail
    out.reusable_tokens = d.reusable_tokens
    out.engine_id = d.engine_id
    out.claimed = result.claimed
    if peek:
        return
    if d.params is not None:
        apply_handout(result.params_blob, d.params, out.kv_transfer_params)
    if d.release is not None:
        apply_handout(result.params_blob, d.release, out.release_params)
    if result.check is not None:
        c = out.check
        c.num_tokens, c.block_size = result.check.num_tokens, result.check.block_size
        c.block_digests, c.whole_only = result.check.digests, result.check.whole_only
        c.recompute_threshold = result.threshold

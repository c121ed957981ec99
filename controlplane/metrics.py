"""Prometheus metrics of the daemon (served on their own port by daemon.py)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

LOOKUPS = Counter("kvferry_lookups_total", "Lookups by decision and reason", ["decision", "reason"])
CLAIMS = Counter("kvferry_claims_total", "Retentions consumed by a lookup (pull or release)", ["kind"])
REGISTRATIONS = Counter("kvferry_lease_registrations_total", "Retention registrations", ["outcome"])
NODE_REGISTRATIONS = Counter("kvferry_node_registrations_total", "Node registrations", ["outcome"])
REUSABLE_TOKENS = Counter("kvferry_reusable_tokens_total", "Tokens handed to prefill nodes to pull")
LIVE_RETENTIONS = Gauge("kvferry_live_leases", "Live retentions per node (periodic scan)", ["engine_id"])
HELD_TOKENS = Gauge(
    "kvferry_held_tokens", "Tokens held for live retentions per node (periodic scan)", ["engine_id"]
)
NODES_ALIVE = Gauge("kvferry_nodes_alive", "Nodes whose liveness lease holds")
ATTACHED = Gauge("kvferry_attached_streams", "Open Nodes/Attach streams on this replica")
ETCD_LATENCY = Histogram("kvferry_etcd_seconds", "etcd request latency", ["op"], buckets=_LATENCY_BUCKETS)
ETCD_ERRORS = Counter("kvferry_etcd_errors_total", "Failed etcd requests", ["op", "code"])
GC_LEASE_GRANTS = Counter("kvferry_gc_lease_grants_total", "Shared GC leases granted")
NODE_LEASE_GRANTS = Counter("kvferry_node_lease_grants_total", "Node liveness leases granted")
NODES_COLLECTED = Counter("kvferry_nodes_collected_total", "Records of long-dead nodes deleted")
ETCD_BATCH_ITEMS = Histogram(
    "kvferry_etcd_batch_items",
    "Transactions per etcd request (group commit)",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
INDEXED_HASHES = Counter("kvferry_kv_event_hashes_total", "Block hashes folded into the KV-event index")
INDEXED_BLOCKS = Gauge("kvferry_indexed_blocks", "Blocks in the KV-event index (this replica)")
NODE_VIEW_SOLE = Gauge(
    "kvferry_node_view_sole",
    "1 while this replica provably knows every node demotion since its last read (it wrote "
    "them, or the other replicas promised to tell it first), and so decides pulls with no "
    "read of etcd (controlplane.solewriter)",
)
NOTICE_PROMISES = Gauge(
    "kvferry_node_notice_promises",
    "Other replicas this one promised to tell of its node demotions first, promises not lapsed "
    "(controlplane.notices): each may decide pulls on its own view beside this one",
)
DEMOTION_NOTICES = Counter(
    "kvferry_node_demotion_notices_total",
    "Notices of a node demotion this replica sent to a replica holding its promise, by "
    "outcome (answered; unanswered: the write waited until that promise lapsed), "
    "controlplane.notices",
    ["outcome"],
)
RPC_LATENCY = Histogram("kvferry_rpc_seconds", "gRPC handler latency", ["method"], buckets=_LATENCY_BUCKETS)
RELEASES = Counter(
    "kvferry_retention_releases_total",
    "Retentions released before a turn claimed them, by reason (budget, near_full, idle, "
    "conversation_end, expiry; orphan: a claim's put-back the next registration or a "
    "revoke overtook, the sidecars counting their own orphans)",
    ["reason"],
)
OWNED_SHARDS = Gauge("kvferry_owned_shards", "Claim shards this replica owns (controlplane.owners)")
OWNER_WRITES_QUEUED = Gauge(
    "kvferry_owner_writes_queued", "Decisions of the owned shards whose etcd writes are still behind"
)
FAILOVER_RETENTIONS = Counter(
    "kvferry_failover_retentions_total",
    "Retentions found at an unclean takeover of a shard: treated as spent, their blocks released",
)
RELAYED = Counter(
    "kvferry_release_relay_total",
    "Releases of nodes not attached to the replica that decided them (controlplane.service."
    "relay), by outcome: forwarded (the replica the node is attached to took them), local "
    "(it attached here), expired (their deadline passed first: D freed the blocks), dropped "
    "(too many held)",
    ["outcome"],
)
FORWARDED = Counter(
    "kvferry_owner_forwarded_total", "Operations forwarded to a shard's owner replica", ["op"]
)
RETAINED_BLOCK_SECONDS = Counter(
    "kvferry_retained_block_seconds_total",
    "D KV block-seconds held by retentions (nodes attached to this replica); over "
    "kvferry_reusable_tokens_total: block-seconds held per reused token",
)
POOL_BLOCKS = Gauge("kvferry_pool_blocks", "KV blocks in a decode node's pool (its sidecar)", ["engine_id"])
POOL_USAGE = Gauge(
    "kvferry_pool_usage", "Share of a decode node's KV pool in use (its sidecar)", ["engine_id"]
)
RETAINED_BLOCKS = Gauge(
    "kvferry_retained_blocks", "D KV blocks held by live retentions (this replica's count)", ["engine_id"]
)

LOOKUP_WAITS = Histogram(
    "kvferry_lookup_wait_seconds",
    "Time lookups spent waiting on etcd, by what they waited for (node_confirm: the read that "
    "confirms a pull's decode node, service/nodecache.py); a lookup that waited for nothing "
    "is not counted",
    ["on"],
    buckets=_LATENCY_BUCKETS,
)
LOOP_LAG = Histogram(
    "kvferry_event_loop_lag_seconds",
    "How late the daemon's event loop ran a timer (controlplane.stalls): what every request "
    "waited behind then",
    buckets=_LATENCY_BUCKETS,
)
GC_PAUSES = Histogram(
    "kvferry_gc_pause_seconds",
    "Cyclic garbage collections of the daemon process and how long each paused it, by generation",
    ["generation"],
    buckets=_LATENCY_BUCKETS,
)


def show_pool(engine_id: str, blocks: int, usage: float, retained: int) -> None:
    """Set a node's pool gauges."""
    POOL_BLOCKS.labels(engine_id).set(blocks)
    POOL_USAGE.labels(engine_id).set(usage)
    RETAINED_BLOCKS.labels(engine_id).set(retained)


def forget_pool(engine_id: str) -> None:
    """Drop a node's pool gauges (its stream ended)."""
    for gauge in (POOL_BLOCKS, POOL_USAGE, RETAINED_BLOCKS):
        with contextlib.suppress(KeyError):
            gauge.remove(engine_id)


_lookup_children: dict[tuple[bool, str], Counter] = {}
_claim_children: dict[str, Counter] = {}


def lookup(pull: bool, reason: str) -> None:
    """Count one lookup (label children cached: this is the hot path)."""
    child = _lookup_children.get((pull, reason))
    if child is None:
        child = _lookup_children[(pull, reason)] = LOOKUPS.labels("PULL" if pull else "RECOMPUTE", reason)
    child.inc()


def claim(kind: str) -> None:
    """Count one retention consumed by a lookup: pull, release or dead (label children cached)."""
    child = _claim_children.get(kind)
    if child is None:
        child = _claim_children[kind] = CLAIMS.labels(kind)
    child.inc()

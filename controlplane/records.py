"""What kvferry stores in etcd, and where. Pure data: no I/O.

Key layout under a configurable prefix (default ``/kvferry``)::

    <prefix>/nodes/<engine_id>                    NodeRecord (no lease)
    <prefix>/alive/<engine_id>                    generation, on the node's liveness lease
    <prefix>/retentions/<tenant>/<conversation>   Retention, on a shared time-bucketed GC lease
    <prefix>/claimed/<tenant>/<conversation>      Claim marker, on a shared GC lease
    <prefix>/meta/scan-bounds                     Window bounds of the gauge scan (no lease)
    <prefix>/meta/generation-floor                Highest generation of a deleted node record
    <prefix>/owners/<shard>                       OwnerRecord, on the owning replica's lease
    <prefix>/shardstate/<shard>                   ShardState (no lease): how the last owner left

Path segments are percent-encoded, so ids may contain ``/`` without ambiguity.
Values are JSON (msgspec), readable with ``etcdctl get``.
"""

from __future__ import annotations

import enum
import math
import re
from urllib.parse import quote, unquote

import msgspec


class Role(enum.IntEnum):
    """Mirrors kvferry.v1.Role."""

    UNSPECIFIED = 0
    PREFILL = 1
    DECODE = 2
    BOTH = 3


class NodeRecord(msgspec.Struct, frozen=True):
    """A node registration as stored (its liveness is a key of its own: see the layout)."""

    engine_id: str
    role: Role
    model: str
    block_size: int
    http_url: str
    side_channel_host: str
    side_channel_port: int
    generation: int
    registered_at: float
    liveness_ttl: int
    lease_id: int = 0
    # Set when the node was deregistered: the record stays as a tombstone that
    # remembers the generation (a new registration gets a newer one).
    removed_at: float = 0.0
    # The engine's own server behind the sidecar at http_url ("" = none; older records).
    engine_url: str = ""
    # When the engine process started (Unix seconds; 0 = unknown): the same start time
    # registered again is the same process (see NodeRegistration.engine_started_at).
    engine_started_at: float = 0.0
    # Set when the node was suspended: its sidecar's Attach stream ended, so nobody vouches
    # for the engine process any more. Its liveness ended at once (its retentions answer
    # node_gone) and the generation stays: registered again with it by a sidecar that
    # confirmed the same process, the retentions are good again; a new process gets a new one.
    suspended_at: float = 0.0


class Retention(msgspec.Struct, frozen=True):
    """One conversation's D blocks: the params D returned and what they cover."""

    engine_id: str
    generation: int
    # D's kv_transfer_params exactly as received, serialized (a google.protobuf.Struct):
    # opaque here, forwarded byte for byte, unknown keys included.
    params: bytes
    num_tokens: int
    block_size: int
    created_at: float
    expires_at: float
    digests: bytes = b""
    request_id: str = ""
    """The request whose answer D holds the blocks for (its X-Request-Id); "" = unknown."""
    whole_only: bool = False
    """Only a pull of every token is safe: a KV-cache group names vLLM's null block (a
    sliding window's freed positions), which a pull cut short could hand P where its
    window needs data."""


class HeldSummary(msgspec.Struct, frozen=True):
    """The fields of a Retention the per-node gauges need. Decoding only these skips the
    params and digests (most of a value's bytes) without materialising them."""

    engine_id: str
    num_tokens: int
    expires_at: float
    block_size: int = 0
    created_at: float = 0.0


class Claim(msgspec.Struct, frozen=True):
    """Left behind when a retention was handed out, so later lookups can say why, and
    Leases/Get what took it. (The claim transaction writes it in the same step that reads
    the retention: it knows the claiming request, not the retention's engine nor its
    deadline; writing those in afterwards would cost every turn an etcd write.)"""

    claimed_at: float
    expires_at: float = 0.0
    """The deadline of the retention the claim took, when the daemon wrote it in after the
    claim (it does for a retention it found expired or about to: `policy.decide_claimed`
    then answers expired past it); 0 = not known."""
    engine_id: str = ""
    """The engine of the retention taken, known when the deadline is ("" = not known)."""
    claimed_by: str = ""
    """The request whose lookup claimed it (its X-Request-Id; "" = the lookup named none)."""


class OwnerRecord(msgspec.Struct, frozen=True):
    """Which replica owns a shard (controlplane.owners), and where the others reach it."""

    replica: str
    address: str = ""
    """Its advertised gRPC address ("": none, a lone replica)."""
    stream_address: str = ""
    """Its framed Leases/Stream's address, at the advertised host ("": it serves none)."""


class ShardState(msgspec.Struct, frozen=True):
    """How a shard's last owner left it: written `clean=False` when a replica takes the
    shard, `clean=True` (with its fence) when it hands it over after flushing every write."""

    clean: bool
    replica: str = ""
    fence: int = 0
    """The fence of the owner that left cleanly (0 while owned: the key's own revision)."""


class NodeState(msgspec.Struct, frozen=True):
    """A node as the policy sees it: its record and whether its liveness key exists."""

    record: NodeRecord
    alive: bool
    until: float = math.inf
    """Wall-clock time its liveness ends unless a heartbeat moves it (as its liveness key
    says; infinity when the key does not say, or was not read)."""

    def alive_at(self, now: float) -> bool:
        """Whether it is alive at wall-clock time `now` (its liveness lapses at `until`)."""
        return self.alive and now < self.until


_node_encoder = msgspec.json.Encoder()
_retention_decoder = msgspec.json.Decoder(Retention)
_node_decoder = msgspec.json.Decoder(NodeRecord)
_claim_decoder = msgspec.json.Decoder(Claim)
_summary_decoder = msgspec.json.Decoder(HeldSummary)
_bounds_decoder = msgspec.json.Decoder(list[bytes])


_owner_decoder = msgspec.json.Decoder(OwnerRecord)
_state_decoder = msgspec.json.Decoder(ShardState)


def encode(obj: NodeRecord | Retention | Claim | OwnerRecord | ShardState) -> bytes:
    """A record as stored (JSON)."""
    return _node_encoder.encode(obj)


def decode_retention(raw: bytes) -> Retention:
    """A stored retention (raises one of kvferry.decoding.UNDECODABLE)."""
    return _retention_decoder.decode(raw)


def decode_summary(raw: bytes) -> HeldSummary:
    """The gauge fields of a stored retention, skipping the rest."""
    return _summary_decoder.decode(raw)


def encode_bounds(bounds: list[bytes]) -> bytes:
    """Gauge-scan window bounds as stored."""
    return _node_encoder.encode(bounds)


def decode_bounds(raw: bytes) -> list[bytes]:
    """Stored gauge-scan window bounds."""
    return _bounds_decoder.decode(raw)


def decode_node(raw: bytes) -> NodeRecord:
    """A stored node record."""
    return _node_decoder.decode(raw)


def decode_claim(raw: bytes) -> Claim:
    """A stored claim marker."""
    return _claim_decoder.decode(raw)


def decode_owner(raw: bytes) -> OwnerRecord:
    """A stored shard owner."""
    return _owner_decoder.decode(raw)


def decode_state(raw: bytes) -> ShardState:
    """A stored shard state."""
    return _state_decoder.decode(raw)


_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]*")
"""What `quote` leaves as it is: most ids (a fast path; keys are built on every claim)."""


def _seg(s: str) -> str:
    return s if _UNRESERVED.fullmatch(s) else quote(s, safe="")


class Keys:
    """Key builders for one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.nodes = f"{self.prefix}/nodes/".encode()
        self.alive = f"{self.prefix}/alive/".encode()
        self.retentions = f"{self.prefix}/retentions/".encode()
        self.claimed = f"{self.prefix}/claimed/".encode()
        self.scan_bounds = f"{self.prefix}/meta/scan-bounds".encode()
        self.generation_floor = f"{self.prefix}/meta/generation-floor".encode()
        self.replicas = f"{self.prefix}/replicas/".encode()
        self.owners = f"{self.prefix}/owners/".encode()
        self.shard_states = f"{self.prefix}/shardstate/".encode()

    def owner(self, shard: int) -> bytes:
        """The key naming a shard's owner replica."""
        return self.owners + str(shard).encode()

    def shard_state(self, shard: int) -> bytes:
        """The key of a shard's state (how its last owner left)."""
        return self.shard_states + str(shard).encode()

    def replica(self, replica_id: str) -> bytes:
        """The key announcing a daemon replica."""
        return self.replicas + _seg(replica_id).encode()

    def replica_id(self, key: bytes) -> str:
        """The replica id of an announcement key."""
        return unquote(key[len(self.replicas) :].decode(errors="replace"))

    def node(self, engine_id: str) -> bytes:
        """The key of a node's record."""
        return self.nodes + _seg(engine_id).encode()

    def alive_key(self, engine_id: str) -> bytes:
        """The key of a node's liveness."""
        return self.alive + _seg(engine_id).encode()

    def retention(self, tenant: str, conversation_id: str) -> bytes:
        """The key of a conversation's retention."""
        return self.retentions + f"{_seg(tenant)}/{_seg(conversation_id)}".encode()

    def tenant_retentions(self, tenant: str) -> bytes:
        """The prefix of a tenant's retentions."""
        return self.retentions + f"{_seg(tenant)}/".encode()

    def claim(self, tenant: str, conversation_id: str) -> bytes:
        """The key of a conversation's claim marker."""
        return self.claimed + f"{_seg(tenant)}/{_seg(conversation_id)}".encode()

    def split_retention(self, key: bytes) -> tuple[str, str]:
        """(tenant, conversation_id) of a retention or claim key."""
        rest = key.decode()
        for base in (self.retentions.decode(), self.claimed.decode()):
            if rest.startswith(base):
                tenant, _, conv = rest[len(base) :].partition("/")
                return unquote(tenant), unquote(conv)
        raise ValueError(f"not a retention key: {key!r}")

    def engine_of(self, key: bytes) -> str:
        """The engine id of a node or liveness key."""
        rest = key.decode()
        for base in (self.nodes.decode(), self.alive.decode()):
            if rest.startswith(base):
                return unquote(rest[len(base) :])
        raise ValueError(f"not a node key: {key!r}")


def prefix_end(prefix: bytes) -> bytes:
    """The etcd range end that covers every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"

"""The daemon's settings: one typed object, parsed once from flags and environment.

Every flag defaults to its ``KVFERRY_*`` environment variable (the flag name
upper-cased, dashes as underscores), then to the value below.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path

from controlplane.budget import DEFAULT_NEAR_FULL, DEFAULT_SHARE, Budget
from controlplane.nodeurls import NodeNetworks
from controlplane.policy import Policy
from kvferry.flags import Flag, add_flags, bool_text, boolean, items, joined, settings_from
from kvferry.ids import MAX_ID_BYTES
from kvferry.limits import ANSWER_VALID_S, MAX_LIVENESS_TTL_S, MAX_PORT, MIN_LIVENESS_TTL_S
from kvferry.security.policy import Policy as AccessPolicy
from kvferry.security.policy import load_policy
from kvferry.security.tls import TlsFiles, check_listen
from kvferry.urls import split_host_port

ENV_PREFIX = "KVFERRY_"
EMBEDDED_PEER_PORT_OFFSET = 10
"""The embedded etcd's peer port is its client port plus this."""
METRICS_OFF = -1
"""The metrics port that turns the metrics server off."""


@dataclass(frozen=True)
class EtcdSettings:
    """The etcd cluster the daemon keeps its state in."""

    endpoints: tuple[str, ...] = ()
    """host:port of each member; empty = start the embedded etcd."""
    prefix: str = "/kvferry"
    """Key prefix all of kvferry's keys live under."""
    timeout_s: float = 2.0
    """Per-request timeout for etcd calls, seconds."""
    dns_refresh_s: float = 10.0
    """Seconds between lookups of the endpoints' names, when several are names (a member
    restarted under a new address is followed; see controlplane.etcd.channel_target)."""
    data_dir: Path = Path(".kvferry/etcd")
    """Where the embedded etcd keeps its data (survives restarts)."""
    embedded_client_port: int = 23790
    """The embedded etcd's client port."""
    embedded_peer_port: int = embedded_client_port + EMBEDDED_PEER_PORT_OFFSET
    """The embedded etcd's peer port."""
    ca: Path | None = None
    """CA that signed the external etcd's server certificate (None: plaintext to etcd)."""
    cert: Path | None = None
    """Client certificate the daemon presents to etcd (its --client-cert-auth)."""
    key: Path | None = None
    """That certificate's private key."""

    @property
    def tls(self) -> bool:
        """Whether the daemon speaks TLS to etcd."""
        return self.ca is not None


@dataclass(frozen=True)
class ServerSettings:
    """The daemon's gRPC server and its metrics."""

    listen: str = "127.0.0.1:50051"
    """gRPC listen address."""
    advertise: str = ""
    """host:port the other replicas reach this one at ("" = the listen address, or for a
    wildcard one this host's resolved name): Nodes/Score asks them for their sidecars'."""
    metrics_port: int = 9464
    """Prometheus metrics port on the same host as listen; 0 = pick one, -1 = off."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest gRPC message accepted, bytes (a 128k-token retention's digests are ~128 KiB)."""
    grace_s: float = 5.0
    """Seconds in-flight RPCs get to finish on SIGTERM."""
    stream_listen: str = ""
    """Also serve Leases/Stream's ops framed, without gRPC, on this host:port ("" = off;
    kvferry.framedstream): TLS and who may call as on `listen`."""


@dataclass(frozen=True)
class SecuritySettings:
    """TLS on the daemon's listeners, and who may call it (see README "Security model")."""

    tls_ca: Path | None = None
    """CA that signed the clients' certificates (and the peer replicas')."""
    tls_cert: Path | None = None
    """This daemon's certificate: served to clients, presented to peer replicas."""
    tls_key: Path | None = None
    """Its private key."""
    policy: Path | None = None
    """The policy file: identities, roles, token digests (None: every caller is an admin)."""
    insecure: bool = False
    """Serve plaintext on a non-loopback address all the same."""
    token_listen: str = ""
    """A second TLS address that asks for no client certificate, for people with a bearer
    token of the policy (grpcurl, `kvferry --token`); "" = none. (gRPC's Python server
    either requires client certificates or never asks for one: the main port requires.)"""

    def tls_files(self) -> TlsFiles | None:
        """The TLS files (None: plaintext); ValueError naming what is missing or unreadable."""
        return TlsFiles.from_flags(self.tls_ca, self.tls_cert, self.tls_key)

    def access_policy(self) -> AccessPolicy | None:
        """The policy, loaded (None: development mode); PolicyError naming the bad entry."""
        return None if self.policy is None else load_policy(self.policy)

    def named_tls_files(self) -> TlsFiles | None:
        """The TLS files as named, not read (None: not all three given)."""
        ca, cert, key = self.tls_ca, self.tls_cert, self.tls_key
        return TlsFiles(ca, cert, key) if ca and cert and key else None

    def validate(self, listen: str) -> None:
        """Raise ValueError on flags that do not go together (the files are not read here:
        see `Settings.load_files`)."""
        ca, cert, key = self.tls_ca, self.tls_cert, self.tls_key
        tls = self.named_tls_files()
        if tls is None and (ca or cert or key):
            TlsFiles.from_flags(ca, cert, key)  # (raises, naming the missing flags)
        problem = check_listen(listen, tls, self.insecure)
        if problem:
            raise ValueError(problem)
        if self.token_listen and (tls is None or self.policy is None):
            raise ValueError("--token-listen needs TLS (--tls-ca, --tls-cert, --tls-key) and --policy")


@dataclass(frozen=True)
class NodeSettings:
    """Nodes' liveness and records."""

    liveness_ttl_s: int = 10
    """A node's liveness lapses this long after its last heartbeat, unless it asks for another TTL."""
    cache_refresh_s: float = 0.5
    """How stale this replica's view of node liveness and generations may get."""
    gc_after_s: float = 86_400.0
    """A node record dead (deregistered, or its liveness lapsed) this long is deleted,
    seconds; 0 = kept forever. Engine ids that never come back (pods named by a
    Deployment) would otherwise pile up in etcd and in every replica's refresh."""
    networks: NodeNetworks = field(default_factory=NodeNetworks)
    """The networks a node's URLs and side channel must lie in (empty: any address but
    link-local, metadata, unspecified, multicast and broadcast ones; see controlplane.nodeurls)."""


@dataclass(frozen=True)
class GcSettings:
    """The etcd leases that expire retentions, and the gauges' scan."""

    bucket_s: int = 60
    """Retention deadlines are grouped into buckets this wide; one etcd lease (a GC lease)
    per bucket."""
    max_keys_per_lease: int = 10_000
    """At most this many keys are attached to one GC lease; a full bucket gets another."""
    claim_marker_s: int = 600
    """How long the marker of a claimed retention is kept, for "already_claimed"."""
    gauge_scan_s: float = 30.0
    """Interval of the per-node live-retention / held-token gauge scan, seconds; 0 = off."""


MAX_SHARDS = 4096
"""Most claim shards (each is an etcd key and a compare in its writes)."""


@dataclass(frozen=True)
class OwnerSettings:
    """How claim shards are owned (controlplane.owners)."""

    shards: int = 32
    ttl_s: int = 5
    """TTL of the ownership lease: a crashed owner's shards are free after it."""
    margin_s: float = 1.0
    """Validity ends this long before the lease could lapse in etcd."""
    grace_s: float = 5.0
    """After an unclean takeover, how long the spent retentions' blocks are kept before
    they are released (a pull the old owner answered may still be running: clients use an
    answer at most kvferry.limits.ANSWER_VALID_S after their lookup left)."""
    wait_s: float = 1.0
    """How long an operation waits for its shard (taken, loaded, valid) before it answers
    store_unavailable."""
    balance_s: float = 1.0
    """Seconds between passes that take free shards and hand over those past the share."""
    marker_s: float = 600.0
    """How long claim markers are kept (set from GcSettings.claim_marker_s)."""


@dataclass(frozen=True)
class Limits:
    """The largest inputs the daemon takes."""

    max_id_bytes: int = MAX_ID_BYTES
    """Longest id (engine, conversation, tenant, request), bytes."""
    max_tokens: int = 4_194_304
    """Largest prompt or retention in tokens (digests are bounded by this / block size)."""
    max_params_bytes: int = 256 * 1024
    """Largest kv_transfer_params, bytes of the serialized google.protobuf.Struct (11 per block id)."""
    max_record_bytes: int = 1 << 20
    """Largest retention record as stored (its params and digests, base64 in JSON): etcd
    refuses a request over its --max-request-bytes (1.5 MiB by default). At 16 tokens a
    block and small params, about 700,000 tokens."""


@dataclass(frozen=True)
class Settings:
    """Everything one daemon replica needs."""

    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    policy: Policy = field(default_factory=Policy)
    nodes: NodeSettings = field(default_factory=NodeSettings)
    gc: GcSettings = field(default_factory=GcSettings)
    limits: Limits = field(default_factory=Limits)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    budget: Budget = field(default_factory=lambda: Budget(DEFAULT_SHARE, DEFAULT_NEAR_FULL))
    owners: OwnerSettings = field(default_factory=OwnerSettings)

    def validate(self) -> None:
        """Raise ValueError on a setting out of range."""
        self.policy.validate()
        self.budget.validate()
        self.security.validate(self.server.listen)
        if self.server.stream_listen:
            problem = check_listen(
                self.server.stream_listen,
                self.security.named_tls_files(),
                self.security.insecure,
                "--stream-listen",
            )
            if problem:
                raise ValueError(problem)
        if not MIN_LIVENESS_TTL_S <= self.nodes.liveness_ttl_s <= MAX_LIVENESS_TTL_S:
            bounds = f"{MIN_LIVENESS_TTL_S}..{MAX_LIVENESS_TTL_S}"
            raise ValueError(f"liveness TTL must be {bounds} s, not {self.nodes.liveness_ttl_s}")
        if self.gc.gauge_scan_s < 0:
            raise ValueError("gauge scan interval must be 0 (off) or positive")
        if not METRICS_OFF <= self.server.metrics_port <= MAX_PORT:
            raise ValueError(
                f"metrics port must be -1 (off), 0 (any) or a port, not {self.server.metrics_port}"
            )
        if not self.etcd.endpoints:  # the embedded etcd: its client port and peer port
            for name, port in (
                ("client", self.etcd.embedded_client_port),
                ("peer", self.etcd.embedded_peer_port),
            ):
                if not 1 <= port <= MAX_PORT:
                    raise ValueError(f"embedded etcd {name} port {port} is not a port (1..{MAX_PORT})")
        if not 1 <= self.owners.shards <= MAX_SHARDS:
            raise ValueError(f"claim shards must be 1..{MAX_SHARDS}, not {self.owners.shards}")
        if not 2 <= self.owners.ttl_s <= 60:
            raise ValueError(f"owner TTL must be 2..60 s, not {self.owners.ttl_s}")
        if not self.owners.grace_s > ANSWER_VALID_S:
            raise ValueError(
                f"owner grace must exceed the {ANSWER_VALID_S:g} s a client may still use a "
                f"lookup's answer (kvferry.limits.ANSWER_VALID_S), not {self.owners.grace_s}"
            )
        if self.nodes.gc_after_s < 0:
            raise ValueError("node GC delay must be 0 (never) or positive")
        if self.gc.bucket_s < 1 or self.gc.max_keys_per_lease < 1:
            raise ValueError("GC bucket width and keys per lease must be positive")
        if not self.etcd.prefix.startswith("/"):
            raise ValueError("etcd prefix must start with /")
        if self.server.advertise:
            split_host_port(self.server.advertise, "advertise")
        for endpoint in self.etcd.endpoints:
            if split_host_port(endpoint, "etcd endpoint")[1] is None:
                raise ValueError(f"etcd endpoint {endpoint!r} must be host:port")
        if not self.etcd.timeout_s > 0:
            raise ValueError(f"etcd timeout must be positive, not {self.etcd.timeout_s}")
        if not self.etcd.dns_refresh_s > 0:
            raise ValueError(f"etcd DNS refresh must be positive, not {self.etcd.dns_refresh_s}")
        self._validate_etcd_tls()

    def _validate_etcd_tls(self) -> None:
        e = self.etcd
        if (e.cert is None) != (e.key is None):
            missing = "--etcd-key" if e.key is None else "--etcd-cert"
            raise ValueError(
                f"etcd client certificate needs both --etcd-cert and --etcd-key: {missing} is missing"
            )
        if e.cert is not None and e.ca is None:
            raise ValueError("--etcd-cert/--etcd-key need --etcd-ca: the CA of etcd's server certificate")
        if e.ca is not None and not e.endpoints:
            raise ValueError("--etcd-ca is for an external etcd: give its endpoints with --etcd")

    def load_files(self) -> None:
        """Read what the flags name (TLS files, the policy, etcd's TLS files) once, so that
        a missing or bad one stops the start with its name. Raises ValueError."""
        self.security.tls_files()
        self.security.access_policy()
        e = self.etcd
        for flag, path in (("--etcd-ca", e.ca), ("--etcd-cert", e.cert), ("--etcd-key", e.key)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag} {path}: no such file")


def _path(text: str) -> Path | None:
    """A file flag's value ("" = not given)."""
    return Path(text) if text else None


def _path_text(value: Path | None) -> str:
    return "" if value is None else str(value)


FLAGS = (
    Flag("listen", "server.listen", "gRPC address (host:port)"),
    Flag(
        "stream-listen",
        "server.stream_listen",
        'also serve Leases/Stream framed, without gRPC, on host:port ("" = off): faster per op',
    ),
    Flag(
        "tls-ca",
        "security.tls_ca",
        "CA of the clients' certificates (TLS on)",
        to_field=_path,
        to_text=_path_text,
    ),
    Flag(
        "tls-cert", "security.tls_cert", "this daemon's certificate (PEM)", to_field=_path, to_text=_path_text
    ),
    Flag("tls-key", "security.tls_key", "its private key (PEM)", to_field=_path, to_text=_path_text),
    Flag(
        "policy",
        "security.policy",
        "policy file: identities, roles, token digests (none: every caller is an admin)",
        to_field=_path,
        to_text=_path_text,
    ),
    Flag(
        "insecure",
        "security.insecure",
        "serve plaintext on a non-loopback address all the same",
        boolean,
        to_text=bool_text,
    ),
    Flag(
        "token-listen",
        "security.token_listen",
        'a TLS address asking for no client certificate, for bearer tokens ("" = none)',
    ),
    Flag(
        "advertise",
        "server.advertise",
        "address other daemon replicas reach this one at: host:port, or a host (or IPv6 address) "
        "to take the listen port (default: from --listen)",
    ),
    Flag("metrics-port", "server.metrics_port", "Prometheus port (0 = pick one, -1 = off)", int),
    Flag(
        "etcd",
        "etcd.endpoints",
        "external etcd endpoints host:port,...; empty = start an embedded etcd",
        to_field=items,
        to_text=joined,
    ),
    Flag(
        "etcd-ca",
        "etcd.ca",
        "CA of the external etcd's server certificate (TLS to etcd)",
        to_field=_path,
        to_text=_path_text,
    ),
    Flag(
        "etcd-cert",
        "etcd.cert",
        "client certificate for the external etcd",
        to_field=_path,
        to_text=_path_text,
    ),
    Flag("etcd-key", "etcd.key", "its private key", to_field=_path, to_text=_path_text),
    Flag("etcd-prefix", "etcd.prefix", "key prefix of all of kvferry's keys"),
    Flag("etcd-timeout", "etcd.timeout_s", "seconds per etcd request", float),
    Flag(
        "etcd-dns-refresh",
        "etcd.dns_refresh_s",
        "seconds between lookups of the etcd endpoints' names (when several are names)",
        float,
    ),
    Flag("data-dir", "etcd.data_dir", "embedded etcd data (kept across restarts)", to_field=Path),
    Flag(
        "embedded-port",
        "etcd.embedded_client_port",
        f"embedded etcd client port (peer: +{EMBEDDED_PEER_PORT_OFFSET})",
        int,
    ),
    Flag("safety-margin", "policy.safety_margin_s", "seconds before D's deadline a pull stops", float),
    Flag("recompute-threshold", "policy.recompute_threshold", "fewest tokens worth pulling", int),
    Flag(
        "default-lifetime",
        "policy.default_lifetime_s",
        "retention lifetime when D sends no deadline (vLLM decoder_kv_blocks_ttl)",
        float,
    ),
    Flag("liveness-ttl", "nodes.liveness_ttl_s", "seconds a node stays alive without a heartbeat", int),
    Flag(
        "node-gc-after",
        "nodes.gc_after_s",
        "seconds a dead node's record is kept before it is deleted (0 = forever)",
        float,
    ),
    Flag(
        "node-networks",
        "nodes.networks",
        "CIDRs a node's URLs and side channel must lie in, comma-separated (names must resolve "
        "into them); empty = any but link-local, metadata, multicast and the like",
        to_field=lambda text: NodeNetworks.parse(items(text)),
        to_text=str,
    ),
    Flag(
        "retention-budget",
        "budget.share",
        "share of a decode node's KV pool its retentions may hold; the least valuable go "
        "first (1.0 = no budget)",
        float,
    ),
    Flag(
        "near-full",
        "budget.near_full",
        "pool use (share) above which a decode node's retentions give room first (1.0 = never)",
        float,
    ),
    Flag(
        "idle-release",
        "budget.idle_factor",
        "release a retention idle FACTOR x the 99th-percentile turn interval seen (after 50 "
        "seen; at least 10 s), whatever the budget (0 = off: held to its deadline)",
        float,
    ),
    Flag(
        "claim-shards",
        "owners.shards",
        "conversations are split into this many shards, each owned by one replica that "
        "decides its claims in memory (the same on every replica)",
        int,
    ),
    Flag(
        "owner-ttl",
        "owners.ttl_s",
        "seconds a crashed replica's shards stay owned (its ownership lease's TTL)",
        int,
    ),
    Flag("gc-bucket", "gc.bucket_s", "seconds of retention deadlines per shared GC lease", int),
    Flag("gauge-scan", "gc.gauge_scan_s", "seconds between per-node gauge scans (0 = off)", float),
)
"""The daemon's flags, in --help's order."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The daemon's flags; each defaults to its KVFERRY_* environment variable."""
    add_flags(p, ENV_PREFIX, FLAGS, Settings())


def from_args(a: argparse.Namespace) -> Settings:
    """Settings from parsed flags; raises ValueError when invalid."""
    s = settings_from(a, FLAGS, Settings())
    peer_port = s.etcd.embedded_client_port + EMBEDDED_PEER_PORT_OFFSET
    s = replace(s, etcd=replace(s.etcd, embedded_peer_port=peer_port))
    s.validate()
    return s

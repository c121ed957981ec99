"""The daemon's settings: one typed object, parsed once from flags and environment."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.policy import Policy
from kvferry.flags import flag_adder
from kvferry.ids import MAX_ID_BYTES
from kvferry.limits import MAX_LIVENESS_TTL_S, MAX_PORT, MIN_LIVENESS_TTL_S
from kvferry.urls import split_host_port

ENV_PREFIX = "KVFERRY_"
METRICS_OFF = -1
"""The metrics port that turns the metrics server off."""


@dataclass(frozen=True)
class EtcdSettings:
    # "host:port,host:port"; empty = start the embedded etcd.
    endpoints: tuple[str, ...] = ()
    # Key prefix all of kvferry's keys live under.
    prefix: str = "/kvferry"
    # Per-request timeout for etcd calls, seconds.
    timeout_s: float = 2.0
    # Seconds between lookups of the endpoints' names, when several are names (a member
    # restarted under a new address is followed; see controlplane.etcd.channel_target).
    dns_refresh_s: float = 10.0
    # Embedded etcd: where it keeps its data (survives restarts) and its client port.
    data_dir: Path = Path(".kvferry/etcd")
    embedded_client_port: int = 23790
    embedded_peer_port: int = 23800


@dataclass(frozen=True)
class ServerSettings:
    # gRPC listen address.
    listen: str = "127.0.0.1:50051"
    # host:port the other replicas reach this one at ("" = the listen address, or for a
    # wildcard one this host's resolved name): Nodes/Score asks them for their sidecars'.
    advertise: str = ""
    # Prometheus metrics port on the same host as listen; 0 = pick one, -1 = off.
    metrics_port: int = 9464
    # Largest gRPC message accepted, bytes (a 128k-token lease's digests are ~128 KiB).
    max_message_bytes: int = 4 * 1024 * 1024
    # Seconds in-flight RPCs get to finish on SIGTERM.
    grace_s: float = 5.0


@dataclass(frozen=True)
class NodeSettings:
    # A node's liveness lapses this long after its last heartbeat, unless it asks for another TTL.
    liveness_ttl_s: int = 10
    # How stale this replica's view of node liveness and generations may get.
    cache_refresh_s: float = 0.5
    # A node record dead (deregistered, or its liveness lapsed) this long is deleted,
    # seconds; 0 = kept forever. Engine ids that never come back (pods named by a
    # Deployment) would otherwise pile up in etcd and in every replica's refresh.
    gc_after_s: float = 86_400.0


@dataclass(frozen=True)
class GcSettings:
    # Retention deadlines are grouped into buckets this wide; one etcd lease per bucket.
    bucket_s: int = 60
    # At most this many keys are attached to one GC lease; a full bucket gets another.
    max_keys_per_lease: int = 10_000
    # How long the marker of a claimed retention is kept, for "already_claimed".
    claim_marker_s: int = 600
    # Interval of the per-node live-lease / held-token gauge scan, seconds; 0 = off.
    gauge_scan_s: float = 30.0


@dataclass(frozen=True)
class Limits:
    max_id_bytes: int = MAX_ID_BYTES
    # Largest prompt/lease in tokens (digests are bounded by this / block size).
    max_tokens: int = 4_194_304
    # Largest kv_transfer_params, bytes of the serialized google.protobuf.Struct (11 per block id).
    max_params_bytes: int = 256 * 1024


@dataclass(frozen=True)
class Settings:
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    policy: Policy = field(default_factory=Policy)
    nodes: NodeSettings = field(default_factory=NodeSettings)
    gc: GcSettings = field(default_factory=GcSettings)
    limits: Limits = field(default_factory=Limits)

    def validate(self) -> None:
        self.policy.validate()
        if not MIN_LIVENESS_TTL_S <= self.nodes.liveness_ttl_s <= MAX_LIVENESS_TTL_S:
            bounds = f"{MIN_LIVENESS_TTL_S}..{MAX_LIVENESS_TTL_S}"
            raise ValueError(f"liveness TTL must be {bounds} s, not {self.nodes.liveness_ttl_s}")
        if self.gc.gauge_scan_s < 0:
            raise ValueError("gauge scan interval must be 0 (off) or positive")
        if not METRICS_OFF <= self.server.metrics_port <= MAX_PORT:
            raise ValueError(
                f"metrics port must be -1 (off), 0 (any) or a port, not {self.server.metrics_port}"
            )
        if not self.etcd.endpoints:  # the embedded etcd: its client port and peer port (+10)
            for name, port in (
                ("client", self.etcd.embedded_client_port),
                ("peer", self.etcd.embedded_peer_port),
            ):
                if not 1 <= port <= MAX_PORT:
                    raise ValueError(f"embedded etcd {name} port {port} is not a port (1..{MAX_PORT})")
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The daemon's flags; each defaults to its KVFERRY_* environment variable."""
    d = Settings()
    add = flag_adder(p, ENV_PREFIX)
    add("listen", d.server.listen, "gRPC address (host:port)")
    add(
        "advertise",
        d.server.advertise,
        "address other daemon replicas reach this one at: host:port, or a host (or IPv6 address) "
        "to take the listen port (default: from --listen)",
    )
    add("metrics-port", d.server.metrics_port, "Prometheus port (0 = pick one, -1 = off)", int)
    add("etcd", "", "external etcd endpoints host:port,...; empty = start an embedded etcd")
    add("etcd-prefix", d.etcd.prefix, "key prefix of all of kvferry's keys")
    add("etcd-timeout", d.etcd.timeout_s, "seconds per etcd request", float)
    add(
        "etcd-dns-refresh",
        d.etcd.dns_refresh_s,
        "seconds between lookups of the etcd endpoints' names (when several are names)",
        float,
    )
    add("data-dir", d.etcd.data_dir, "embedded etcd data (kept across restarts)")
    add("embedded-port", d.etcd.embedded_client_port, "embedded etcd client port (peer: +10)", int)
    add("safety-margin", d.policy.safety_margin_s, "seconds before D's deadline a pull stops", float)
    add("recompute-threshold", d.policy.recompute_threshold, "fewest tokens worth pulling", int)
    add(
        "default-lifetime",
        d.policy.default_lifetime_s,
        "retention lifetime when D sends no deadline (vLLM decoder_kv_blocks_ttl)",
        float,
    )
    add("liveness-ttl", d.nodes.liveness_ttl_s, "seconds a node stays alive without a heartbeat", int)
    add(
        "node-gc-after",
        d.nodes.gc_after_s,
        "seconds a dead node's record is kept before it is deleted (0 = forever)",
        float,
    )
    add("gc-bucket", d.gc.bucket_s, "seconds of retention deadlines per shared GC lease", int)
    add("gauge-scan", d.gc.gauge_scan_s, "seconds between per-node gauge scans (0 = off)", float)


def from_args(a: argparse.Namespace) -> Settings:
    endpoints = tuple(e.strip() for e in a.etcd.split(",") if e.strip())
    s = Settings(
        etcd=EtcdSettings(
            endpoints=endpoints,
            prefix=a.etcd_prefix,
            timeout_s=a.etcd_timeout,
            dns_refresh_s=a.etcd_dns_refresh,
            data_dir=Path(a.data_dir),
            embedded_client_port=a.embedded_port,
            embedded_peer_port=a.embedded_port + 10,
        ),
        server=ServerSettings(listen=a.listen, advertise=a.advertise, metrics_port=a.metrics_port),
        policy=Policy(
            safety_margin_s=a.safety_margin,
            recompute_threshold=a.recompute_threshold,
            default_lifetime_s=a.default_lifetime,
        ),
        nodes=NodeSettings(liveness_ttl_s=a.liveness_ttl, gc_after_s=a.node_gc_after),
        gc=GcSettings(bucket_s=a.gc_bucket, gauge_scan_s=a.gauge_scan),
    )
    s.validate()
    return s

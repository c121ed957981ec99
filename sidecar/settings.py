"""The sidecar's settings: one typed object, parsed once from flags and environment.

Every flag defaults to its ``KVFERRY_SIDECAR_*`` environment variable (the flag
name upper-cased, dashes as underscores), then to the value below.
"""

from __future__ import annotations

import argparse
import re
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from kvferry.flags import Flag, add_flags, bool_text, boolean, items, joined, seconds, settings_from
from kvferry.framedstream import check_stream_addresses
from kvferry.ids import id_problem
from kvferry.limits import MAX_BLOCK_SIZE, MAX_LIFETIME_S, MAX_LIVENESS_TTL_S, MAX_PORT, MIN_LIVENESS_TTL_S
from kvferry.security.tls import TlsFiles, check_listen
from kvferry.security.tls import is_loopback as reachable_only_here
from kvferry.turnheaders import TENANT_HEADER
from kvferry.urls import is_http_url, is_loopback, listen_host_port

ROLES = ("prefill", "decode", "both")
ENV_PREFIX = "KVFERRY_SIDECAR_"
#: Most data-parallel ranks the sidecar follows (one SUB socket, and a replay, each).
MAX_RANKS = 256
#: The shortest blocks TTL taken, seconds.
MIN_BLOCKS_TTL_S = 1.0


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM server this sidecar stands next to."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of the engine's OpenAI-compatible server."""
    engine_id: str = ""
    """The node's id at the daemon, stable across engine restarts; "" = <hostname>-<engine port>."""
    role: str = "decode"
    """prefill, decode or both (only decode and both nodes register retentions)."""
    model: str = ""
    """Base model; "" = learned from the engine's /v1/models."""
    api_key: str = ""
    """Bearer key for the sidecar's own requests to the engines' /v1 routes (vLLM's
    --api-key guards them; "" = none): its engine's /v1/models, and the releases it sends
    through a prefill node (so the engines share it). Requests it relays keep their own
    Authorization."""
    block_size: int = 0
    """Tokens per KV block; 0 = learned from vllm:cache_config_info in /metrics, else 16."""
    side_channel_host: str = ""
    """NIXL side-channel host as prefill nodes reach it; "" = this host's address."""
    side_channel_port: int = 5600
    """NIXL side-channel port (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT + dp rank)."""
    health_interval_s: float = 1.0
    """Seconds between /health probes."""
    health_timeout_s: float = 2.0
    """A /health probe slower than this failed."""
    health_failures: int = 3
    """Consecutive failed probes after which the engine counts as down (and, once back, restarted)."""
    blocks_ttl_s: float = 480.0
    """The engine's decoder_kv_blocks_ttl: no retention outlives D's params by more (D has
    freed the blocks by then, whatever deadline it sent), and one without D's own deadline
    (remote_blocks_expiry_time: releases before vLLM sent it) gets exactly that. Set it to
    vLLM's: a smaller one cuts retentions short, a larger one does not lengthen them."""


@dataclass(frozen=True)
class KvEventSettings:
    """The engine's KV-event stream (vLLM --kv-events-config)."""

    endpoint: str = ""
    """ZMQ PUB endpoint to subscribe to, e.g. tcp://127.0.0.1:5557; "" = no KV events."""
    replay_endpoint: str = ""
    """ZMQ ROUTER endpoint for replays, e.g. tcp://127.0.0.1:5558; "" = gaps are not replayed."""
    topic: str = ""
    """Topic to subscribe to ("" = all)."""
    flush_interval_s: float = 0.02
    """Longest time a folded change waits before it is sent to the daemon."""
    flush_hashes: int = 16384
    """Send at once when this many hashes are pending."""
    replay_timeout_s: float = 2.0
    """A replay that has not ended after this long is given up."""
    ranks: int = 1
    """The engine's data-parallel ranks on this node: the endpoints are its first rank's,
    and rank r after it publishes on both endpoints' TCP port + r, as vLLM's publishers
    do; all are followed."""

    def for_rank(self, rank: int) -> KvEventSettings:
        """The endpoints rank `rank` of the engine publishes on."""
        return replace(
            self,
            endpoint=rank_endpoint(self.endpoint, rank),
            replay_endpoint=rank_endpoint(self.replay_endpoint, rank),
        )


def rank_endpoint(endpoint: str, rank: int) -> str:
    """TCP `endpoint` of data-parallel rank `rank` (counted from the first's), as vLLM
    offsets it (ZmqEventPublisher.offset_endpoint_port): the port plus the rank."""
    if not endpoint or rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


@dataclass(frozen=True)
class DaemonSettings:
    """How to reach the kvferry daemon."""

    addresses: tuple[str, ...] = ("127.0.0.1:50051",)
    """Daemon replicas (host:port); the sidecar fails over between them."""
    stream_addresses: tuple[str, ...] = ()
    """The same replicas' --stream-listen addresses, in the same order: registrations then
    go over the framed stream, without gRPC (kvferry.framedstream); empty = over gRPC."""
    liveness_ttl_s: int = 10
    """Seconds the node stays alive without a heartbeat (2..3600)."""
    rpc_timeout_s: float = 5.0
    """Deadline of a unary call to the daemon."""
    backoff_initial_s: float = 0.1
    """First delay before reconnecting after a failure."""
    backoff_max_s: float = 5.0
    """Longest delay between reconnection attempts."""


@dataclass(frozen=True)
class TapSettings:
    """The HTTP reverse proxy in front of the engine."""

    listen: str = "127.0.0.1:8100"
    """host:port the proxy listens on (port 0 picks a free one). Another address than a
    loopback one needs TLS (`SecuritySettings`), or --insecure."""
    advertise_url: str = ""
    """URL registered as the node's http_url; "" = http://<side-channel host>:<listen port>."""
    advertise_engine_url: str = ""
    """URL registered as the node's engine_url (the router tokenizes and prefills there,
    skipping the tap, which only reads decode answers); "" = the engine URL unless it is a
    loopback address while http_url is not; "none" = never (everything goes through the tap)."""
    tenant_header: str = TENANT_HEADER
    """Header naming the tenant of a request that did not come from the router ("" or
    absent = the daemon's default tenant); the router's always name it in
    `kvferry.turnheaders.TENANT_HEADER`, whatever this says."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted, as sent and decompressed alike (413 beyond)."""
    max_bodies_bytes: int = 256 * 1024 * 1024
    """Request body bytes held at once by all requests in flight (503 beyond)."""
    head_timeout_s: float = 10.0
    """A request's head must arrive within this of its first byte (of the connection's
    opening, for its first request): else 408 and the connection is closed."""
    body_timeout_s: float = 60.0
    """A request's body must arrive within this of its head (408 beyond)."""
    idle_timeout_s: float = 15.0
    """An idle keep-alive connection is closed after this (more than the router's and
    sidecars' pools keep one: `kvferry.hops.KEEPALIVE_S`)."""
    connect_timeout_s: float = 10.0
    """Timeout for connecting to the engine."""


@dataclass(frozen=True)
class RetentionSettings:
    """Retention registrations waiting for the daemon."""

    queue_size: int = 1024
    """Registrations kept while the daemon is unreachable; the oldest is dropped beyond."""
    max_attempts: int = 5
    """Tries per registration before it is dropped."""
    max_in_flight: int = 64
    """Registrations sent on the stream and not yet answered."""
    retry_pause_max_s: float = 1.0
    """The longest pause between tries while the daemon cannot take registrations (the
    pauses grow from --daemon-backoff, capped here and by --daemon-backoff-max): a retention
    is worth less by the second, and a pause of the node's 5 s kept reuse away that long
    after etcd got its quorum back (the fault suite)."""


@dataclass(frozen=True)
class SecuritySettings:
    """TLS and who may call the tap (see `sidecar.access`); none of it: development mode."""

    tls_ca: str = ""
    """CA (PEM) the tap verifies clients' certificates against, and the daemon's and
    other nodes' with; with --tls-cert and --tls-key, the tap serves HTTPS."""
    tls_cert: str = ""
    """This sidecar's certificate (PEM): the tap's server certificate, and its client
    certificate to the daemon and to other nodes. Re-read when the file changes."""
    tls_key: str = ""
    """The certificate's private key (PEM)."""
    policy: str = ""
    """Policy file (TOML, `kvferry.security.policy`): who may call the tap; "" = every
    caller is trusted as an admin (development mode)."""
    insecure: bool = False
    """Let the tap listen on a non-loopback address without TLS (plaintext on purpose)."""

    @property
    def tls_files(self) -> TlsFiles | None:
        """The TLS files named (not read), or None; ValueError when only some are."""
        given = {"--tls-ca": self.tls_ca, "--tls-cert": self.tls_cert, "--tls-key": self.tls_key}
        if not any(given.values()):
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise ValueError(
                f"TLS needs --tls-ca, --tls-cert and --tls-key together; missing {', '.join(missing)}"
            )
        return TlsFiles(Path(self.tls_ca), Path(self.tls_cert), Path(self.tls_key))


@dataclass(frozen=True)
class Settings:
    """Everything one sidecar needs."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    kv_events: KvEventSettings = field(default_factory=KvEventSettings)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    tap: TapSettings = field(default_factory=TapSettings)
    retentions: RetentionSettings = field(default_factory=RetentionSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)

    def validate(self) -> None:
        """Raise ValueError on a setting out of range."""
        e = self.engine
        if not is_http_url(e.url):
            raise ValueError(f"engine url {e.url!r} must be an http:// or https:// URL with a host")
        engine_url = "" if self.tap.advertise_engine_url == "none" else self.tap.advertise_engine_url
        for name, url in (("advertise-url", self.tap.advertise_url), ("advertise-engine-url", engine_url)):
            if url and not is_http_url(url):
                raise ValueError(f"{name} {url!r} must be an http:// or https:// URL with a host")
        if e.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {e.role!r}")
        if not 0 <= e.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block size must be in 0..{MAX_BLOCK_SIZE} (0 = learn it)")
        if not 0 < e.side_channel_port <= MAX_PORT:
            raise ValueError("side-channel port must be a port number")
        if e.health_interval_s <= 0 or e.health_timeout_s <= 0 or e.health_failures < 1:
            raise ValueError("health interval and timeout must be positive, failures at least 1")
        problem = id_problem("engine id", e.engine_id)  # (refused by the daemon, it never registers)
        if problem:
            raise ValueError(problem)
        k = self.kv_events
        for endpoint in (k.endpoint, k.replay_endpoint):
            if endpoint and not _ZMQ_ENDPOINT.match(endpoint):
                raise ValueError(f"KV-event endpoint {endpoint!r} must be a ZMQ endpoint (tcp://host:port)")
        if k.replay_endpoint and not k.endpoint:
            raise ValueError("a KV-event replay endpoint needs the KV-event endpoint")
        if k.flush_interval_s <= 0 or k.flush_hashes < 1 or k.replay_timeout_s <= 0:
            raise ValueError("KV-event flush interval, flush size and replay timeout must be positive")
        if not 1 <= k.ranks <= MAX_RANKS:
            raise ValueError(f"KV-event ranks (the engine's data-parallel size) must be in 1..{MAX_RANKS}")
        if k.ranks > 1:
            _rank_ports(k)
        if not MIN_BLOCKS_TTL_S <= self.engine.blocks_ttl_s <= MAX_LIFETIME_S:  # (the daemon's horizon)
            raise ValueError(f"blocks TTL must be in {MIN_BLOCKS_TTL_S:g}..{MAX_LIFETIME_S:g} s")
        d = self.daemon
        if not d.addresses or any(":" not in a for a in d.addresses):
            raise ValueError("daemon addresses must be host:port")
        check_stream_addresses(d.addresses, d.stream_addresses)
        if not MIN_LIVENESS_TTL_S <= d.liveness_ttl_s <= MAX_LIVENESS_TTL_S:
            raise ValueError(f"liveness TTL must be in {MIN_LIVENESS_TTL_S}..{MAX_LIVENESS_TTL_S} s")
        if d.rpc_timeout_s <= 0 or not 0 < d.backoff_initial_s <= d.backoff_max_s:
            raise ValueError("RPC timeout and backoff must be positive, initial <= max")
        if not self.retentions.retry_pause_max_s > 0:
            raise ValueError("--registration-retry-max must be positive")
        listen_host_port(self.tap.listen)
        _check_tap_limits(self.tap)
        plaintext = check_listen(self.tap.listen, self.security.tls_files, self.security.insecure)
        if plaintext:
            raise ValueError(plaintext)
        host, _ = listen_host_port(self.tap.listen)
        if not (self.security.policy or self.security.insecure or reachable_only_here(host)):
            raise ValueError(
                f"--listen {self.tap.listen} is not a loopback address and no --policy is given: "
                "every caller, one without a certificate too, would be an admin of the tap; give "
                "--policy (see `kvferry certs`), or --insecure to serve it so anyway"
            )
        r = self.retentions
        if r.queue_size < 1 or r.max_attempts < 1 or r.max_in_flight < 1:
            raise ValueError("registration queue size, attempts and in-flight limit must be positive")

    @property
    def node_id(self) -> str:
        """The engine id the node registers under."""
        if self.engine.engine_id:
            return self.engine.engine_id
        port = urlsplit(self.engine.url).port or 80
        return f"{socket.gethostname()}-{port}"

    @property
    def scheme(self) -> str:
        """The tap's URL scheme: https with TLS."""
        return "https" if self.security.tls_cert else "http"

    @property
    def side_channel_host(self) -> str:
        """The side-channel host prefill nodes are told."""
        return self.engine.side_channel_host or default_host()


def default_host() -> str:
    """This host's address as other hosts see it (best effort), else its name.

    The host name's address first; when that is a loopback one (Debian and Ubuntu map the
    host name to 127.0.1.1), the address this host sends from on its default route (a UDP
    socket "connected" to a documentation address: no packet leaves). Only a host with no
    route keeps the loopback address, which serves nodes on this host alone."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = name
    if not is_loopback(address):
        return address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            routed = str(probe.getsockname()[0])
    except OSError:
        return address
    return address if is_loopback(routed) else routed


#: tcp://HOST:PORT (PORT a number or *), ipc://PATH, inproc://NAME: what zmq connects to.
_ZMQ_ENDPOINT = re.compile(r"^(tcp://[^/\s]+:(\d+|\*)|ipc://\S+|inproc://\S+)$")


def _rank_ports(k: KvEventSettings) -> None:
    """Check the endpoints can name `k.ranks` ranks: TCP ports (vLLM offsets no other),
    all in range, the publishers' apart from the replays' (ValueError)."""
    runs = []
    for endpoint in filter(None, (k.endpoint, k.replay_endpoint)):
        port = endpoint.rpartition(":")[2]
        if not endpoint.startswith("tcp://") or not port.isdigit():
            raise ValueError(f"KV-event endpoint {endpoint!r}: ranks need a TCP port to add each rank to")
        if int(port) + k.ranks - 1 > MAX_PORT:
            raise ValueError(f"KV-event endpoint {endpoint!r}: port + ranks - 1 must be at most {MAX_PORT}")
        runs.append(range(int(port), int(port) + k.ranks))
    if len(runs) == 2 and set(runs[0]) & set(runs[1]):
        raise ValueError("the ranks' KV-event ports and their replay ports overlap: move the replay port")


#: The smallest body limit taken (a chat request with a long prompt must pass).
MIN_BODY_BYTES = 64 * 1024


def _check_tap_limits(t: TapSettings) -> None:
    """Raise ValueError on a body limit or deadline of the tap out of range."""
    if t.max_body_bytes < MIN_BODY_BYTES:
        raise ValueError(f"max body bytes must be at least {MIN_BODY_BYTES}")
    if t.max_bodies_bytes < t.max_body_bytes:
        raise ValueError("max bodies bytes (all requests) must be at least max body bytes (one request)")
    if min(t.head_timeout_s, t.body_timeout_s, t.idle_timeout_s) <= 0:
        raise ValueError("head, body and idle timeouts must be positive")


def listen_address(s: Settings) -> tuple[str, int]:
    """(host, port) the tap binds."""
    return listen_host_port(s.tap.listen)


FLAGS = (
    Flag(
        "engine-url",
        "engine.url",
        "base URL of the engine's OpenAI server",
        to_field=lambda url: url.rstrip("/"),
    ),
    Flag("listen", "tap.listen", "host:port the HTTP tap listens on"),
    Flag(
        "daemon",
        "daemon.addresses",
        "daemon address(es), host:port[,host:port...]",
        to_field=items,
        to_text=joined,
    ),
    Flag(
        "daemon-stream",
        "daemon.stream_addresses",
        "the daemon replicas' --stream-listen address(es), as --daemon's: registrations go framed",
        to_field=items,
        to_text=joined,
    ),
    Flag("role", "engine.role", "prefill, decode or both"),
    Flag("engine-id", "engine.engine_id", "node id at the daemon (default <hostname>-<engine port>)"),
    Flag("model", "engine.model", "base model (default: learned from /v1/models)"),
    Flag(
        "engine-api-key",
        "engine.api_key",
        "bearer key for the engines (vLLM --api-key): /v1/models, releases via P",
    ),
    Flag("block-size", "engine.block_size", "tokens per KV block (0: learn from /metrics, else 16)", int),
    Flag("side-channel-host", "engine.side_channel_host", "NIXL side-channel host prefill nodes reach"),
    Flag("side-channel-port", "engine.side_channel_port", "NIXL side-channel port", int),
    Flag("kv-events-endpoint", "kv_events.endpoint", "engine's KV-event ZMQ PUB endpoint (empty: off)"),
    Flag("kv-events-replay-endpoint", "kv_events.replay_endpoint", "engine's KV-event replay endpoint"),
    Flag("kv-events-topic", "kv_events.topic", "KV-event topic"),
    Flag(
        "kv-events-ranks",
        "kv_events.ranks",
        "the engine's data-parallel ranks on this node (the endpoints are the first's; rank r: port + r)",
        int,
    ),
    Flag(
        "max-body-bytes",
        "tap.max_body_bytes",
        "largest request body, sent and decompressed (413 beyond)",
        int,
    ),
    Flag(
        "max-bodies-bytes",
        "tap.max_bodies_bytes",
        "request body bytes held at once by all requests (503 beyond)",
        int,
    ),
    Flag("head-timeout", "tap.head_timeout_s", "seconds a request's head may take to arrive (408)", seconds),
    Flag(
        "body-timeout",
        "tap.body_timeout_s",
        "seconds a request's body may take after its head (408)",
        seconds,
    ),
    Flag("idle-timeout", "tap.idle_timeout_s", "seconds an idle keep-alive connection is kept", seconds),
    Flag("tenant-header", "tap.tenant_header", "header naming the tenant of requests not from the router"),
    Flag("advertise-url", "tap.advertise_url", "URL registered as the node's http_url"),
    Flag(
        "advertise-engine-url",
        "tap.advertise_engine_url",
        "URL registered as the node's engine_url, for tokenize and prefill requests "
        '("" = the engine URL when the router can reach it; "none" = never)',
    ),
    Flag("liveness-ttl", "daemon.liveness_ttl_s", "seconds the node stays alive without a heartbeat", int),
    Flag("health-interval", "engine.health_interval_s", "seconds between engine /health probes", float),
    Flag("health-failures", "engine.health_failures", "failed probes after which the engine is down", int),
    Flag(
        "blocks-ttl",
        "engine.blocks_ttl_s",
        "the engine's decoder_kv_blocks_ttl: the longest a retention lives after D's answer",
        float,
    ),
    Flag(
        "lease-queue-size", "retentions.queue_size", "registrations kept while the daemon is unreachable", int
    ),
    Flag(
        "registration-retry-max",
        "retentions.retry_pause_max_s",
        "longest pause, seconds, between registration tries while the daemon is in trouble",
        float,
    ),
    Flag(
        "tls-ca",
        "security.tls_ca",
        "CA (PEM) that clients', the daemon's and other nodes' certificates are checked with",
    ),
    Flag(
        "tls-cert",
        "security.tls_cert",
        "this sidecar's certificate (PEM): HTTPS server and client to the daemon",
    ),
    Flag("tls-key", "security.tls_key", "the certificate's private key (PEM)"),
    Flag("policy", "security.policy", "policy file (TOML): who may call the tap (empty: everyone, as admin)"),
    Flag(
        "insecure",
        "security.insecure",
        "serve plaintext on a non-loopback address (without TLS)",
        boolean,
        to_text=bool_text,
    ),
)
"""The sidecar's flags, in --help's order."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sidecar's flags; each defaults to KVFERRY_SIDECAR_<FLAG>."""
    add_flags(p, ENV_PREFIX, FLAGS, Settings())


def from_args(a: argparse.Namespace) -> Settings:
    """Settings from parsed flags; raises ValueError when invalid."""
    s = settings_from(a, FLAGS, Settings())
    s.validate()
    return s

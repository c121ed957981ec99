"""The router's settings: one typed object, parsed once from flags and environment.

Every flag defaults to its ``KVFERRY_ROUTER_*`` environment variable (the flag
name upper-cased, dashes as underscores), then to the value below.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.flags import Flag, add_flags, bool_text, boolean, items, joined, seconds, settings_from
from kvferry.framedstream import check_stream_addresses
from kvferry.limits import ANSWER_VALID_S, MAX_BLOCK_SIZE
from kvferry.security.tls import RELOAD_CHECK_S, TlsFiles, check_listen
from kvferry.urls import is_http_url, listen_host_port

ENV_PREFIX = "KVFERRY_ROUTER_"
MIN_BODY_BYTES = 1024
"""The smallest --max-body-bytes taken (a chat request's envelope alone is larger)."""


@dataclass(frozen=True)
class ServerSettings:
    """The OpenAI-compatible HTTP front door."""

    listen: str = "127.0.0.1:8000"
    """host:port to listen on (port 0 picks a free one). Off loopback it needs TLS, or
    `SecuritySettings.insecure`."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted."""
    shutdown_grace_s: float = 5.0
    """Seconds in-flight answers get to finish on shutdown."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys a client must present on /v1/ routes, as vLLM's --api-key; empty = no check."""
    trace_out: str = ""
    """A file to append one line per finished turn to (`router.trace`: timing, sizes and
    reuse, no content), for `kvferry plan`; "" = none."""
    head_timeout_s: float = 10.0
    """A request's head must arrive within this of its first byte (of the connection's
    opening, for its first request): else 408 and the connection is closed."""
    body_timeout_s: float = 60.0
    """A request's body must arrive within this of its head (408 beyond)."""
    idle_timeout_s: float = 75.0
    """An idle keep-alive connection is closed after this (aiohttp's default)."""


@dataclass(frozen=True)
class DaemonSettings:
    """The kvferry daemon: node discovery and retention lookups."""

    addresses: tuple[str, ...] = ()
    """Daemon replicas (host:port); empty = no daemon: static nodes, no reuse."""
    stream_addresses: tuple[str, ...] = ()
    """The same replicas' --stream-listen addresses, in the same order: lookups then go over
    the framed stream, without gRPC (kvferry.framedstream); empty = over gRPC."""
    lookup_deadline_s: float = 0.05
    """The base of a lookup's wait, from when the prompt is known: a lookup slower than its
    wait is given up and the turn served without reuse (see `router.patience`)."""
    lookup_recompute_share: float = 0.25
    """Share of the prompt's estimated recompute time a lookup may wait on top of the base
    (a pull spares that time; waiting risks it): 0 = the base alone."""
    lookup_max_wait_s: float = 1.0
    """Longest a lookup is waited for, however long the prompt (a daemon that answers at all
    answers in milliseconds; beyond a second it is in trouble, and waiting only costs);
    never less than the base. Below `kvferry.limits.ANSWER_VALID_S`: an answer is never
    used later than that after its lookup left (its claim may have been spent since), so a
    longer wait could not be had."""
    prefill_s_per_token: float = 1e-4
    """Estimated prefill seconds per prompt token until the router has measured its own
    prefills (fresh ones of at least 256 computed tokens, per model): 100 us is a 7-8B
    model on one GPU, about 3 s for 32k tokens."""
    late_answer_s: float = 120.0
    """How long a lookup given up on (late, or its client gone) is still awaited: what the
    daemon claimed for it is released through P when it comes (D would hold it to its TTL,
    480 s by default). A daemon that hung, or waited on a stalled etcd, answers late."""
    score_deadline_s: float = 0.05
    """Same for Nodes/Score (prefill choice by cached prefix)."""
    rpc_timeout_s: float = 2.0
    """Deadline of Nodes/List."""
    nodes_refresh_s: float = 1.0
    """Seconds between Nodes/List refreshes."""
    breaker_base_s: float = 0.1
    """After a failed lookup, skip lookups this long (doubling per failure)."""
    breaker_max_s: float = 1.0
    """Longest time lookups are skipped after failures."""
    owner_routes: bool = True
    """Send each lookup to the replica owning its conversation's claim shard (Leases/Routes,
    learned with each node refresh), not through the replica in use, which would forward it."""

    def validate(self) -> None:
        """Raise ValueError on an address that is not host:port, stream addresses that do not
        pair with the replicas, or a timing out of range."""
        if any(":" not in a for a in self.addresses):
            raise ValueError("daemon addresses must be host:port")
        check_stream_addresses(self.addresses, self.stream_addresses)
        positive = (
            "lookup_deadline_s",
            "lookup_max_wait_s",
            "score_deadline_s",
            "rpc_timeout_s",
            "nodes_refresh_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"daemon {name} must be positive")
        if self.lookup_max_wait_s >= ANSWER_VALID_S or self.lookup_deadline_s >= ANSWER_VALID_S:
            raise ValueError(
                f"daemon lookup_max_wait_s and lookup_deadline_s must be below {ANSWER_VALID_S:g} s, "
                "the longest an answer is valid after its lookup left"
            )
        if not 0 <= self.lookup_recompute_share <= 1:
            raise ValueError("daemon lookup_recompute_share must be in 0..1")
        if self.prefill_s_per_token < 0 or self.late_answer_s < 0:
            raise ValueError("daemon prefill_s_per_token and late_answer_s must be >= 0")
        if not 0 < self.breaker_base_s <= self.breaker_max_s:
            raise ValueError("breaker base must be positive and at most the breaker maximum")


@dataclass(frozen=True)
class NodeSettings:
    """Engines given on the command line: given, they replace discovery from the daemon
    (then asked for lookups only)."""

    prefill_urls: tuple[str, ...] = ()
    """Base URLs of prefill nodes (their sidecars when they have one)."""
    decode_urls: tuple[str, ...] = ()
    """Base URLs of decode nodes (their sidecars: D's answers must pass one to be retained)."""
    model: str = ""
    """Base model of the static nodes; "" = learned from their /v1/models."""
    block_size: int = 16
    """Tokens per KV block of the static nodes."""


@dataclass(frozen=True)
class UpstreamSettings:
    """How the router talks to the engines."""

    connect_timeout_s: float = 5.0
    """Timeout to connect to an engine."""
    prefill_timeout_s: float = 600.0
    """Longest a prefill request may take."""
    decode_idle_timeout_s: float = 1800.0
    """Longest D may stay silent: before its answer starts, between two chunks of a stream,
    or while it generates a whole non-streaming answer (long reasoning answers take minutes).
    A silent D is given up; what the client got so far ends there."""
    tokenize_timeout_s: float = 5.0
    """Longest a tokenize request may take; a slower one means serving that turn without reuse."""
    api_key: str = ""
    """Bearer key to send the engines; "" = forward the client's Authorization header."""
    forward_prompt_token_ids: bool = False
    """Put the prompt's token ids (from P's /tokenize) in P's and D's kv_transfer_params
    (``prompt_token_ids``) on chat requests, for engines that take them instead of
    rendering the messages again: vLLM 0.32 does (PR 48145), earlier releases ignore them
    (64k ids per turn of a long prompt, sent twice for nothing). Off: each engine renders
    the request itself, which /tokenize renders alike (`router.decisions.reproducible`)."""
    tokenizer: str = ""
    """A directory with the model's tokenizer files (tokenizer.json, and the chat template in
    tokenizer_config.json or chat_template.jinja): the router tokenizes prompts itself
    instead of asking P's /tokenize (`router.tokenizer`), after checking that each node's
    /tokenize gives the same ids; "" = P tokenizes."""
    tokenizer_recheck_s: float = 300.0
    """Seconds after which a node's /tokenize is compared with the local tokenizer again."""
    health_interval_s: float = 1.0
    """Seconds between the router's /health probes of each node the daemon listed (through
    its sidecar). A node failing them is left out whatever the daemon says; a node the
    daemon lists as lapsed (its etcd or itself impaired) is kept while it answers them."""
    health_timeout_s: float = 5.0
    """A /health probe slower than this failed (generous: a busy engine is not a dead one)."""
    health_failures: int = 3
    """Failed probes in a row after which a node is left out (until it answers again)."""
    max_releases_in_flight: int = 256
    """Most releases on their way at once, of both kinds: of P's blocks after D refused a
    turn, and of D's blocks after a lookup answered too late. A node that is slow to
    answer them would otherwise gather an unbounded backlog; a release not sent leaves
    the blocks to their holder's own timeout."""


@dataclass(frozen=True)
class ReuseSettings:
    """Conversation identity and KV reuse."""

    enabled: bool = True
    """Ask the daemon for the previous turn's KV; off = plain P/D serving for every request."""
    digest_cache_bytes: int = 128 << 20
    """Memory for each conversation's last prompt (token ids and block digests, about 5
    bytes per token), so its next turn hashes only its new blocks; 0 = hash every block."""


@dataclass(frozen=True)
class SecuritySettings:
    """TLS and the policy file (`kvferry.security`); none of it given: development mode,
    plaintext, on loopback only."""

    tls_ca: str = ""
    """The CA (PEM) the router trusts for its peers: the daemon, sidecars and engines."""
    tls_cert: str = ""
    """The router's certificate (PEM): its HTTPS front door's, and its identity to the
    daemon, sidecars and engines (mTLS)."""
    tls_key: str = ""
    """The key of `tls_cert` (PEM)."""
    policy: str = ""
    """The policy file: its ``[clients.*]`` are API keys (their SHA-256 digests) and the
    tenant of each; given, a client needs one of them (or an --api-key key)."""
    insecure: bool = False
    """Serve plaintext on an address off loopback anyway (a warning is logged)."""
    reload_check_s: float = RELOAD_CHECK_S
    """How often the TLS files are looked at for a rotation (no flag: tests shorten it)."""

    def named_tls_files(self) -> TlsFiles | None:
        """The TLS files named, not read (None: none); ValueError when only some are named."""
        named = {"--tls-ca": self.tls_ca, "--tls-cert": self.tls_cert, "--tls-key": self.tls_key}
        missing = [flag for flag, path in named.items() if not path]
        if len(missing) == len(named):
            return None
        if missing:
            raise ValueError(
                f"TLS needs --tls-ca, --tls-cert and --tls-key together; missing {', '.join(missing)}"
            )
        return TlsFiles(Path(self.tls_ca), Path(self.tls_cert), Path(self.tls_key))

    def tls_files(self) -> TlsFiles | None:
        """The TLS files named (None: none), read; ValueError when some are missing or unreadable."""
        return TlsFiles.from_flags(self.tls_ca or None, self.tls_cert or None, self.tls_key or None)


@dataclass(frozen=True)
class Settings:
    """Everything one router needs."""

    server: ServerSettings = field(default_factory=ServerSettings)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    nodes: NodeSettings = field(default_factory=NodeSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    reuse: ReuseSettings = field(default_factory=ReuseSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)

    def validate(self) -> None:
        """Raise ValueError on a setting out of range, TLS files given in part, or a listen
        address off loopback without TLS (and not `insecure`). (The files are read when
        loaded: `router.security.load_security`.)"""
        listen_host_port(self.server.listen)
        sec = self.security
        refused = check_listen(self.server.listen, sec.named_tls_files(), sec.insecure)
        if refused is not None:
            raise ValueError(refused)
        if sec.reload_check_s <= 0:
            raise ValueError("the TLS files' reload check interval must be positive")
        if self.server.max_body_bytes < MIN_BODY_BYTES or self.server.shutdown_grace_s < 0:
            raise ValueError("max body must be at least 1 KiB and the shutdown grace >= 0")
        if min(self.server.head_timeout_s, self.server.body_timeout_s, self.server.idle_timeout_s) <= 0:
            raise ValueError("head, body and idle timeouts must be positive")
        d = self.daemon
        d.validate()
        n = self.nodes
        for url in (*n.prefill_urls, *n.decode_urls):
            if not is_http_url(url):
                raise ValueError(f"node url {url!r} must be an http:// or https:// URL with a host")
        if not 0 < n.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block size must be in 1..{MAX_BLOCK_SIZE}")
        if not d.addresses and not (n.prefill_urls and n.decode_urls):
            raise ValueError("give the daemon's address, or prefill and decode node URLs")
        if self.reuse.digest_cache_bytes < 0:
            raise ValueError("the digest cache size must be >= 0")
        u = self.upstream
        timeouts = (u.connect_timeout_s, u.prefill_timeout_s, u.tokenize_timeout_s, u.decode_idle_timeout_s)
        if min(timeouts) <= 0:
            raise ValueError("upstream timeouts must be positive")
        if u.health_interval_s <= 0 or u.health_timeout_s <= 0 or u.health_failures < 1:
            raise ValueError("health interval and timeout must be positive, failures at least 1")
        if u.tokenizer_recheck_s <= 0:
            raise ValueError("upstream tokenizer_recheck_s must be positive")
        if u.max_releases_in_flight < 1:
            raise ValueError("upstream max_releases_in_flight must be at least 1")


def _urls(value: str) -> tuple[str, ...]:
    """The comma-separated URLs (or addresses) of a flag, without trailing slashes."""
    return tuple(x.rstrip("/") for x in items(value))


def _mib(value: float) -> int:
    return int(value * (1 << 20))  # (a finite float: kvferry.flags)


FLAGS = (
    Flag("listen", "server.listen", "host:port of the OpenAI-compatible server"),
    Flag(
        "daemon",
        "daemon.addresses",
        "daemon address(es) host:port[,...]; empty = none",
        to_field=_urls,
        to_text=joined,
    ),
    Flag(
        "daemon-stream",
        "daemon.stream_addresses",
        "the daemon replicas' --stream-listen address(es), as --daemon's: lookups go framed, not gRPC",
        to_field=_urls,
        to_text=joined,
    ),
    Flag(
        "prefill",
        "nodes.prefill_urls",
        "prefill node URL(s), comma-separated (given: no discovery from the daemon)",
        to_field=_urls,
        to_text=joined,
    ),
    Flag(
        "decode",
        "nodes.decode_urls",
        "decode node URL(s) (their sidecars), comma-separated",
        to_field=_urls,
        to_text=joined,
    ),
    Flag("model", "nodes.model", "base model of the static nodes (default: learned from /v1/models)"),
    Flag("block-size", "nodes.block_size", "tokens per KV block of the static nodes", int),
    Flag("lookup-deadline", "daemon.lookup_deadline_s", "base seconds a lookup may take", float),
    Flag(
        "lookup-recompute-share",
        "daemon.lookup_recompute_share",
        "share of the prompt's estimated recompute time a lookup may wait on top (0..1)",
        float,
    ),
    Flag("lookup-max-wait", "daemon.lookup_max_wait_s", "longest a lookup is waited for, s", float),
    Flag(
        "prefill-s-per-token",
        "daemon.prefill_s_per_token",
        "estimated prefill seconds per token until measured",
        float,
    ),
    Flag("nodes-refresh", "daemon.nodes_refresh_s", "seconds between node list refreshes", float),
    Flag(
        "owner-routes",
        "daemon.owner_routes",
        "send each lookup to the daemon replica owning its conversation's shard (false: to the one in use)",
        boolean,
        to_text=bool_text,
    ),
    Flag(
        "reuse",
        "reuse.enabled",
        "KV reuse across turns (false: plain P/D serving)",
        boolean,
        to_text=bool_text,
    ),
    Flag(
        "digest-cache-mb",
        "reuse.digest_cache_bytes",
        "MiB of recent prompts kept so a conversation's next turn hashes only its new blocks",
        float,
        to_field=_mib,
        to_text=lambda size: size >> 20,
    ),
    Flag(
        "api-key",
        "server.api_keys",
        "bearer key(s) clients must present on /v1/, comma-separated; empty = no check",
        to_field=items,
        to_text=joined,
    ),
    Flag("engine-api-key", "upstream.api_key", "bearer key for the engines (default: the client's)"),
    Flag(
        "tls-ca",
        "security.tls_ca",
        "CA (PEM) trusted for the daemon, sidecars and engines; with --tls-cert/key",
    ),
    Flag("tls-cert", "security.tls_cert", "the router's certificate (PEM): HTTPS, and mTLS to its peers"),
    Flag("tls-key", "security.tls_key", "the key of --tls-cert (PEM)"),
    Flag("policy", "security.policy", "policy file: its [clients.*] API keys and their tenants"),
    Flag(
        "insecure",
        "security.insecure",
        "serve plaintext on an address off loopback anyway",
        boolean,
        to_text=bool_text,
    ),
    Flag(
        "forward-prompt-token-ids",
        "upstream.forward_prompt_token_ids",
        "put the prompt's token ids in the engines' kv_transfer_params on chat requests, for "
        "engines that take them (vLLM >= 0.32); false: the engines render the prompt themselves",
        boolean,
        to_text=bool_text,
    ),
    Flag(
        "tokenizer",
        "upstream.tokenizer",
        "directory of the model's tokenizer files (tokenizer.json, tokenizer_config.json): the "
        "router tokenizes prompts itself, checked against each node's /tokenize; empty = P does",
    ),
    Flag(
        "tokenizer-recheck",
        "upstream.tokenizer_recheck_s",
        "seconds after which a node's /tokenize is compared with --tokenizer's ids again",
        float,
    ),
    Flag("connect-timeout", "upstream.connect_timeout_s", "seconds to connect to an engine", float),
    Flag("prefill-timeout", "upstream.prefill_timeout_s", "longest a prefill request may take, s", float),
    Flag(
        "decode-idle-timeout",
        "upstream.decode_idle_timeout_s",
        "longest D may send nothing (before or within its answer), s",
        float,
    ),
    Flag("health-interval", "upstream.health_interval_s", "seconds between node /health probes", float),
    Flag("health-failures", "upstream.health_failures", "failed probes after which a node is left out", int),
    Flag("max-body-bytes", "server.max_body_bytes", "largest request body accepted", int),
    Flag("head-timeout", "server.head_timeout_s", "seconds a request's head may take to arrive", seconds),
    Flag("body-timeout", "server.body_timeout_s", "seconds a request's body may take to arrive", seconds),
    Flag("idle-timeout", "server.idle_timeout_s", "seconds an idle keep-alive connection is kept", seconds),
    Flag(
        "trace-out",
        "server.trace_out",
        "append one line per finished turn (timing, sizes, reuse; no content) to this file, "
        "for `kvferry plan`",
    ),
    Flag(
        "shutdown-grace", "server.shutdown_grace_s", "seconds answers in flight get to end on SIGTERM", float
    ),
)
"""The router's flags, in --help's order."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The router's flags; each defaults to KVFERRY_ROUTER_<FLAG>."""
    add_flags(p, ENV_PREFIX, FLAGS, Settings())


def from_args(a: argparse.Namespace) -> Settings:
    """Settings from parsed flags; raises ValueError when invalid."""
    s = settings_from(a, FLAGS, Settings())
    s.validate()
    return s

"""Prometheus metrics of one router, in a registry of its own (served at /metrics)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvferry.metrics import OwnRegistry
from router.decisions import Failure, FailureKind, Reuse

_SECONDS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STAGE_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class RouterMetrics(OwnRegistry):
    """Every counter, gauge and histogram of the router."""

    def __init__(self) -> None:
        super().__init__()
        self._define_turn_metrics(self.registry)
        self._define_engine_metrics(self.registry)
        self._define_node_metrics(self.registry)

    def _define_turn_metrics(self, r: CollectorRegistry) -> None:
        """What clients asked and got: requests, lookups, reuse, and how long it took."""
        self.requests = Counter(
            "kvferry_router_requests",
            "Client requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.lookups = Counter(
            "kvferry_router_lookups",
            "Turns with a conversation id by lookup decision (PULL, RECOMPUTE, SKIPPED) and reason",
            ["decision", "reason"],
            registry=r,
        )
        self.reused_tokens = Counter(
            "kvferry_router_reused_tokens", "Prompt tokens prefill nodes were told to pull from D", registry=r
        )
        self.ttft = Histogram(
            "kvferry_router_ttft_seconds",
            "Time from a request's arrival to the first answer bytes sent to the client",
            ["reuse"],
            buckets=_SECONDS,
            registry=r,
        )
        self.latency = Histogram(
            "kvferry_router_request_seconds",
            "Time from a request's arrival to the end of its answer",
            ["reuse"],
            buckets=_SECONDS,
            registry=r,
        )
        self.stage = Histogram(
            "kvferry_router_stage_seconds",
            "Time spent per stage of a turn: tokenize, digests (of the prompt's blocks), lookup "
            "(the wait for the daemon's answer once the prompt is tokenized and digested), "
            "prefill, decode_start",
            ["stage"],
            buckets=_STAGE_SECONDS,
            registry=r,
        )

        self.tokenized = Counter(
            "kvferry_router_tokenized",
            "Prompts of conversation turns by who tokenized them: local (--tokenizer), engine "
            "(P's /tokenize: no files given, a request the local path does not render alike, or a "
            "node whose ids differ), compared (both, on a node's check), differed (a check whose "
            "ids were not the engine's: that node's turns go to its /tokenize)",
            ["by"],
            registry=r,
        )

    def _define_engine_metrics(self, r: CollectorRegistry) -> None:
        """What the engines failed and what the router did about it: retries, releases."""
        self.upstream_errors = Counter(
            "kvferry_router_upstream_errors",
            "Failed engine requests by role (tokenize, prefill, decode) and kind",
            ["role", "kind"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "kvferry_router_prefill_retries", "Prefill requests retried, by how", ["how"], registry=r
        )
        self.prefill_releases = Counter(
            "kvferry_router_prefill_releases",
            "Turns D refused after P kept the prompt's blocks for it, by what became of the "
            "release sent to have P free them: released (D answered it; P is told by D), "
            "refused (D answered an error), failed (D not reached), error, skipped (too many "
            "already on their way: P's timeout frees the blocks)",
            ["outcome"],
            registry=r,
        )
        self.claim_releases = Counter(
            "kvferry_router_claim_releases",
            "Lookups answered after their deadline, when the turn had gone on without reuse: "
            "the daemon had claimed D's blocks all the same. By what became of the release "
            "sent through P to have D free them: released, refused (P answered an error), "
            "failed (P not reached), error, skipped (too many releases on their way)",
            ["outcome"],
            registry=r,
        )

    def _define_node_metrics(self, r: CollectorRegistry) -> None:
        """The nodes routed to, and the digest cache."""
        self.nodes = Gauge(
            "kvferry_router_nodes", "Nodes the router routes to, by role", ["role"], registry=r
        )
        self.nodes_lapsed = Gauge(
            "kvferry_router_nodes_lapsed",
            "Nodes routed to that the daemon lists as not alive (their liveness lapsed: etcd, "
            "the daemon or the way to it impaired), kept while their engines answer /health",
            registry=r,
        )
        self.nodes_failing = Gauge(
            "kvferry_router_nodes_failing",
            "Nodes the daemon lists that the router leaves out: they fail its /health probes",
            registry=r,
        )
        self.digest_blocks = Counter(
            "kvferry_router_digest_blocks",
            "Prompt blocks digested for lookups, by how: hashed, or reused from the "
            "conversation's previous turn through this router (the digest cache)",
            ["how"],
            registry=r,
        )
        self.digest_cache_bytes = Gauge(
            "kvferry_router_digest_cache_bytes", "Bytes the digest cache holds", registry=r
        )

    def lookup(self, reuse: Reuse) -> None:
        """Count a turn's lookup decision (and, on a pull, the tokens reused)."""
        self.lookups.labels(reuse.decision, reuse.reason).inc()
        if reuse.pull:
            self.reused_tokens.inc(reuse.reusable_tokens)

    def upstream_error(self, role: str, failure: Failure) -> None:
        """Count a failed engine request of `role` (an engine's status as its class: status_5xx)."""
        kind = failure.kind.value
        if failure.kind is FailureKind.STATUS:
            kind = f"status_{failure.status // 100}xx"
        self.upstream_errors.labels(role, kind).inc()

    def track_nodes(self, counts: Callable[[], dict[str, int]]) -> None:
        """Node gauges read from `counts()`: prefill and decode (nodes routed to), lapsed, failing."""
        for role in ("prefill", "decode"):
            self.nodes.labels(role).set_function(lambda role=role: counts().get(role, 0))  # type: ignore[misc]
        self.nodes_lapsed.set_function(lambda: counts().get("lapsed", 0))
        self.nodes_failing.set_function(lambda: counts().get("failing", 0))

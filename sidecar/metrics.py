"""Prometheus metrics of one sidecar, in a registry of its own (served at /kvferry/metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from kvferry.metrics import OwnRegistry


class SidecarMetrics(OwnRegistry):
    """Every counter and gauge of the sidecar."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.proxied = Counter(
            "kvferry_sidecar_proxied_requests", "Requests proxied to the engine", ["tapped"], registry=r
        )
        self.upstream_errors = Counter(
            "kvferry_sidecar_upstream_errors", "Requests the engine failed to answer", ["stage"], registry=r
        )
        self.turns = Counter(
            "kvferry_sidecar_turns",
            "Tapped answers by outcome (captured, or why nothing was registered)",
            ["outcome"],
            registry=r,
        )
        self.registrations = Counter(
            "kvferry_sidecar_lease_registrations",
            "Registrations by outcome: sent, failed (refused), retry (daemon trouble), requeue (unsent)",
            ["outcome"],
            registry=r,
        )
        self.replaced_releases = Counter(
            "kvferry_sidecar_replaced_releases",
            "Retentions replaced before a turn claimed them, whose D blocks were released through "
            "a prefill node: released, refused (P answered an error), failed, no_prefill, "
            "skipped (too many on their way); all but released leave the blocks to D's TTL",
            ["outcome"],
            registry=r,
        )
        self.registrations_dropped = Counter(
            "kvferry_sidecar_lease_registrations_dropped",
            "Registrations given up: overflow (queue full), expired, restarted (engine), attempts, "
            "maybe_stored (the daemon may have stored it: sending it again is not safe), superseded "
            "(the conversation's next turn came first: D was told to free its blocks), shutdown (queued "
            "when the sidecar stopped), cancelled (on its way when it stopped: maybe stored)",
            ["reason"],
            registry=r,
        )
        self.uncaptured_turns = Counter(
            "kvferry_sidecar_uncaptured_turns",
            "Turns the engine pinned blocks for without saying which (streamed answers without "
            "kv_transfer_params: vLLM without PR 40186): no retention, the next turn recomputes",
            registry=r,
        )
        self.unretained_blocks = Gauge(
            "kvferry_sidecar_unretained_blocks",
            "Blocks the engine pins now for uncaptured turns, until its decoder_kv_blocks_ttl",
            registry=r,
        )
        self.registration_queue = Gauge(
            "kvferry_sidecar_lease_queue", "Registrations waiting to be sent", registry=r
        )
        self.kv_payloads = Counter(
            "kvferry_sidecar_kv_payloads", "KV-event payloads received", ["source"], registry=r
        )
        self.kv_events = Counter(
            "kvferry_sidecar_kv_events_decoded", "KV events decoded", ["type"], registry=r
        )
        self.kv_malformed = Counter(
            "kvferry_sidecar_kv_events_malformed", "KV-event payloads that did not decode", registry=r
        )
        self.kv_unknown = Counter(
            "kvferry_sidecar_kv_events_unknown", "KV events of types this sidecar does not know", registry=r
        )
        self.kv_gaps = Counter("kvferry_sidecar_kv_gaps", "Gaps in the KV-event seq", registry=r)
        self.kv_replays = Counter(
            "kvferry_sidecar_kv_replays", "KV-event replays by outcome", ["outcome"], registry=r
        )
        self.kv_batches_sent = Counter(
            "kvferry_sidecar_kv_batches_sent", "KvEventBatch messages sent to the daemon", registry=r
        )
        self.kv_hashes_sent = Counter(
            "kvferry_sidecar_kv_hashes_sent", "Block hashes sent to the daemon", registry=r
        )
        self.kv_resets = Counter("kvferry_sidecar_kv_resets", "Reset batches (whole mirror) sent", registry=r)
        self.kv_mirror_blocks = Gauge(
            "kvferry_sidecar_kv_mirror_blocks", "Block hashes the engine caches, per its events", registry=r
        )
        self.heartbeats = Counter(
            "kvferry_sidecar_heartbeats", "Heartbeats by outcome (sent, acked)", ["outcome"], registry=r
        )
        self.attaches = Counter(
            "kvferry_sidecar_attaches", "Attach streams by outcome", ["outcome"], registry=r
        )
        self.node_registrations = Counter(
            "kvferry_sidecar_node_registrations", "Nodes/Register calls by outcome", ["outcome"], registry=r
        )
        self.engine_restarts = Counter(
            "kvferry_sidecar_engine_restarts", "Engine restarts detected, by signal", ["signal"], registry=r
        )
        self.engine_suspensions = Counter(
            "kvferry_sidecar_engine_suspensions",
            "Times the engine process was put in doubt (its node suspended until a probe confirms "
            "its identity), by signal: failed (probes), refused (nothing listening), kv_disconnect "
            "(its KV-event publisher went away), facts (another process answered)",
            ["signal"],
            registry=r,
        )
        self.engine_up = Gauge(
            "kvferry_sidecar_engine_up",
            "1 while the engine answers and its process identity is confirmed",
            registry=r,
        )
        self.attached = Gauge("kvferry_sidecar_attached", "1 while an Attach stream is open", registry=r)

"""Prometheus metrics of one sidecar, in a registry of its own (served at /kvferry/metrics)."""

from __future__ import annotations

from kvferry.metrics import OwnRegistry


class SidecarMetrics(OwnRegistry):
    """Every counter and gauge of the sidecar, by the part that counts them."""

    def __init__(self) -> None:
        super().__init__()
        self._tap()
        self._registrations()
        self._kv_events()
        self._node()

    def _tap(self) -> None:
        """The HTTP tap and the turns it reads."""
        self.proxied = self.counter(
            "kvferry_sidecar_proxied_requests", "Requests proxied to the engine", ["tapped"]
        )
        self.upstream_errors = self.counter(
            "kvferry_sidecar_upstream_errors", "Requests the engine failed to answer", ["stage"]
        )
        self.turns = self.counter(
            "kvferry_sidecar_turns",
            "Tapped answers by outcome (captured, or why nothing was registered)",
            ["outcome"],
        )
        self.uncaptured_turns = self.counter(
            "kvferry_sidecar_uncaptured_turns",
            "Turns the engine pinned blocks for without saying which (streamed answers without "
            "kv_transfer_params: vLLM without PR 40186): no retention, the next turn recomputes",
        )
        self.unretained_blocks = self.gauge(
            "kvferry_sidecar_unretained_blocks",
            "Blocks the engine pins now that no retention names (uncaptured turns, dropped "
            "registrations not yet released), until released or its decoder_kv_blocks_ttl",
        )
        self.orphan_blocks = self.gauge(
            "kvferry_sidecar_orphan_blocks",
            "Blocks the engine pins now that no retention names, by reason: stream_without_params "
            "(uncaptured turns), maybe_stored and cancelled (the daemon may hold a retention naming "
            "them: never released, counted until D's TTL), or a dropped registration's reason "
            "(overflow, shutdown, superseded, attempts, failed) or unanswered (a registered "
            "retention whose claim reached nobody) while its release waits",
            ["reason"],
        )

    def _registrations(self) -> None:
        """Retention registrations, and the releases of retentions replaced unclaimed."""
        self.registrations = self.counter(
            "kvferry_sidecar_lease_registrations",
            "Registrations by outcome: sent, failed (refused), retry (daemon trouble), requeue (unsent, "
            "or turned away undecided while etcd stalled)",
            ["outcome"],
        )
        self.replaced_releases = self.counter(
            "kvferry_sidecar_replaced_releases",
            "Releases of D blocks through a prefill node (retentions replaced before a turn claimed "
            "them, and orphans: see kvferry_sidecar_releases_total for which) by outcome: released, "
            "refused (P answered an error), failed, no_prefill, skipped (too many on their way), "
            "cancelled; all but released leave the blocks to D's TTL (an orphan's is tried again)",
            ["outcome"],
        )
        self.registrations_dropped = self.counter(
            "kvferry_sidecar_lease_registrations_dropped",
            "Registrations given up: overflow (queue full), expired, restarted (engine), attempts (D was "
            "told to free its blocks), "
            "maybe_stored (the daemon may have stored it: sending it again is not safe), superseded "
            "(the conversation's next turn came first: D was told to free its blocks), shutdown (queued "
            "when the sidecar stopped), cancelled (on its way when it stopped: maybe stored)",
            ["reason"],
        )
        self.orphans = self.counter(
            "kvferry_sidecar_orphans",
            "Dropped registrations whose D blocks no retention names, by reason and action: "
            "released (D told to free them through a prefill node), counted (maybe stored: not "
            "safe to release), resolved (a later registration of the conversation released them)",
            ["reason", "action"],
        )
        self.releases = self.counter(
            "kvferry_sidecar_releases",
            "Releases of D blocks this sidecar handed a prefill node, by reason: orphan (a "
            "registration given up: stored nowhere), unanswered (a registered retention whose "
            "claim reached nobody), replaced (a retention replaced unclaimed), "
            "conversation_end (the conversation's last turn: not registered), and those the daemon "
            "asked for: budget, near_full, conversation_end (kvferry_retention_releases_total)",
            ["reason"],
        )
        self.held_pins = self.counter(
            "kvferry_sidecar_held_pins",
            "Registered retentions' D requests the daemon was asked about (Leases/Held), by what "
            "it said: retained, claimed (less than its grace ago: asked again later), settled "
            "(nothing to do), orphan (its claim reached nobody: released, reason unanswered)",
            ["state"],
        )
        self.registration_queue = self.gauge(
            "kvferry_sidecar_lease_queue", "Registrations waiting to be sent"
        )

    def _kv_events(self) -> None:
        """The engine's KV events, and what of them goes to the daemon."""
        self.kv_payloads = self.counter(
            "kvferry_sidecar_kv_payloads", "KV-event payloads received", ["source"]
        )
        self.kv_events = self.counter("kvferry_sidecar_kv_events_decoded", "KV events decoded", ["type"])
        self.kv_malformed = self.counter(
            "kvferry_sidecar_kv_events_malformed", "KV-event payloads that did not decode"
        )
        self.kv_unknown = self.counter(
            "kvferry_sidecar_kv_events_unknown", "KV events of types this sidecar does not know"
        )
        self.kv_gaps = self.counter("kvferry_sidecar_kv_gaps", "Gaps in the KV-event seq")
        self.kv_replays = self.counter(
            "kvferry_sidecar_kv_replays", "KV-event replays by outcome", ["outcome"]
        )
        self.kv_batches_sent = self.counter(
            "kvferry_sidecar_kv_batches_sent", "KvEventBatch messages sent to the daemon"
        )
        self.kv_hashes_sent = self.counter(
            "kvferry_sidecar_kv_hashes_sent", "Block hashes sent to the daemon"
        )
        self.kv_resets = self.counter("kvferry_sidecar_kv_resets", "Reset batches (whole mirror) sent")
        self.kv_mirror_blocks = self.gauge(
            "kvferry_sidecar_kv_mirror_blocks", "Block hashes the engine caches, per its events"
        )

    def _node(self) -> None:
        """The node at the daemon, and the engine process behind it."""
        self.heartbeats = self.counter(
            "kvferry_sidecar_heartbeats", "Heartbeats by outcome (sent, acked)", ["outcome"]
        )
        self.attaches = self.counter("kvferry_sidecar_attaches", "Attach streams by outcome", ["outcome"])
        self.node_registrations = self.counter(
            "kvferry_sidecar_node_registrations", "Nodes/Register calls by outcome", ["outcome"]
        )
        self.engine_restarts = self.counter(
            "kvferry_sidecar_engine_restarts", "Engine restarts detected, by signal", ["signal"]
        )
        self.engine_suspensions = self.counter(
            "kvferry_sidecar_engine_suspensions",
            "Times the engine process was put in doubt (its node suspended until a probe confirms "
            "its identity), by signal: failed (probes), refused (nothing listening), kv_disconnect "
            "(its KV-event publisher went away), facts (another process answered)",
            ["signal"],
        )
        self.engine_up = self.gauge(
            "kvferry_sidecar_engine_up", "1 while the engine answers and its process identity is confirmed"
        )
        self.attached = self.gauge("kvferry_sidecar_attached", "1 while an Attach stream is open")

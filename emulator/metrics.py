"""Prometheus metrics of one emulated engine, named like vLLM's where they exist."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from kvferry.metrics import OwnRegistry


class EngineMetrics(OwnRegistry):
    """Counters and gauges in a registry of their own (one per engine)."""

    def __init__(self, model: str, engine_id: str, cache_config: dict[str, str] | None = None) -> None:
        super().__init__()
        self._labels = {"model_name": model, "engine": "0"}
        self._add_vllm_metrics()
        self._add_emulator_metrics()
        self._add_info(model, engine_id, cache_config)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, [*self._labels, *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self._labels), registry=self.registry)

    def _add_vllm_metrics(self) -> None:
        """The metrics vLLM has, with its names, labels and help texts."""
        counter, gauge, labels = self._counter, self._gauge, self._labels
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(
            **labels
        )
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self._prompt_sources = {
            source: by_source.labels(**labels, source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**labels)
        self._request_success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(**labels)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        ).labels(**labels)
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(**labels)
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(**labels)
        self._kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(**labels)

    def _add_emulator_metrics(self) -> None:
        """The emulator's own (``kvferry_emulator:``): pulls, holds, connector faults."""
        counter, gauge, labels = self._counter, self._gauge, self._labels
        self._kv_pulls = counter(
            "kvferry_emulator:kv_pulls",
            "Remote KV pull decisions by outcome (pulled, skipped:*, failed:*).",
            ("outcome",),
        )
        self.kv_pulled_blocks = counter(
            "kvferry_emulator:kv_pulled_blocks", "KV blocks pulled from remote engines."
        ).labels(**labels)
        self.kv_pulled_tokens = counter(
            "kvferry_emulator:kv_pulled_tokens", "Tokens whose KV was pulled."
        ).labels(**labels)
        self.kv_reads_unheld = counter(
            "kvferry_emulator:kv_reads_unheld",
            "Side-channel reads of blocks not held for the request named: a stale or wrong "
            "handout, read silently (as NIXL does), with whatever KV the blocks hold now.",
        ).labels(**labels)
        self.connector_faults = counter(
            "kvferry_emulator:connector_faults",
            "What vLLM's connector would have died on (an assert in the engine process: remote "
            "blocks fewer than the tokens to pull need; here the request fails alone), or leaked "
            "(a decode-side request with params but no prefill's: its blocks pinned for good; "
            "here they expire).",
        ).labels(**labels)
        self.held_requests = gauge(
            "kvferry_emulator:held_requests",
            "Requests whose blocks are held for a remote reader.",
        ).labels(**labels)

    def _add_info(self, model: str, engine_id: str, cache_config: dict[str, str] | None) -> None:
        """Constant gauges: this engine's id, its start time, and (vLLM's) its cache config."""
        self.engine_info = Gauge(
            "kvferry_emulator:engine_info",
            "Constant 1, labelled with the engine id of this generation.",
            ["model_name", "engine_id"],
            registry=self.registry,
        )
        self.engine_info.labels(model_name=model, engine_id=engine_id).set(1)
        # What prometheus_client's process collector shows on vLLM's /metrics: when this
        # engine started (one per emulated engine, not per Python process).
        Gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            registry=self.registry,
        ).set(time.time())
        if cache_config:
            # vLLM's info gauge: how sidecars learn the block size of an engine.
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(cache_config),
                registry=self.registry,
            )
            info.labels(**cache_config).set(1)

    def total(self, family: str) -> float:
        """A counter family summed over its labels (for benchmarks and tests in-process)."""
        return sum(
            sample.value
            for metric in self.registry.collect()
            if metric.name == family
            for sample in metric.samples
            if sample.name.endswith("_total")
        )

    def prompt_sources(self, prompt: int, cache_hit: int, pulled: int) -> None:
        """Count one request's prompt tokens by where their KV came from, as vLLM does:
        its prefix cache, another engine (a pull), or computed here."""
        self._prompt_sources["local_cache_hit"].inc(cache_hit)
        self._prompt_sources["external_kv_transfer"].inc(pulled)
        self._prompt_sources["local_compute"].inc(prompt - cache_hit - pulled)

    def request_finished(self, reason: str) -> None:
        """Count one request that finished normally (stop or length)."""
        self._request_success.labels(**self._labels, finished_reason=reason).inc()

    def kv_pull(self, outcome: str) -> None:
        """Count one pull decision."""
        self._kv_pulls.labels(**self._labels, outcome=outcome).inc()

    def track_kv_cache_usage(self, usage: Callable[[], float]) -> None:
        """Read KV-cache usage at scrape time."""
        self._kv_cache_usage.set_function(usage)

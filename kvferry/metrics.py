"""Prometheus metrics in a registry of their own, one per router, sidecar or engine.

Not the global registry: tests and benchmarks run several of each in one process,
and each must count only its own traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class OwnRegistry:
    """Base of a process's metrics: its registry, served as exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter in this registry."""
        return Counter(name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        """A gauge in this registry."""
        return Gauge(name, documentation, labels, registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        """Exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when absent), for tests and benchmarks."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

"""An engine's /metrics as an operator reads them (vLLM's names; the emulator follows)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

EXTERNAL = "external_kv_transfer"


@dataclass(frozen=True)
class Metrics:
    """One scrape of an engine's /metrics."""

    samples: tuple[tuple[str, Mapping[str, str], float], ...]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )

    def label(self, name: str, label: str) -> str | None:
        for sample, have, _ in self.samples:
            if sample == name and label in have:
                return have[label]
        return None

    @property
    def pulled_tokens(self) -> float:
        """Prompt tokens this engine took from another engine's KV (P's pulls from D)."""
        return self.total("vllm:prompt_tokens_by_source_total", source=EXTERNAL)

    @property
    def used_blocks(self) -> int:
        """KV blocks in use now (held by a request, or pinned for a remote reader)."""
        total = self.label("vllm:cache_config_info", "num_gpu_blocks")
        if not total:
            raise ValueError("the engine's vllm:cache_config_info says no num_gpu_blocks")
        return round(self.total("vllm:kv_cache_usage_perc") * int(total))


async def scrape(http: aiohttp.ClientSession, url: str) -> Metrics:
    """The engine at `url`'s /metrics now (raises aiohttp errors; ValueError on a non-200)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
        if r.status != 200:
            raise ValueError(f"{url}/metrics answered {r.status}")
    samples = tuple(
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )
    return Metrics(samples)

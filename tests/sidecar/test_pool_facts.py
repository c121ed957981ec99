"""D's pool as the sidecar reads it from the engine's /metrics (vLLM's names), for the
daemon's retention budget."""

from __future__ import annotations

import aiohttp

from sidecar.engine import PoolFacts, pool_of
from tests.conftest import StartEmulator

_INFO_LABELS = (
    'block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",'
    'num_cpu_blocks="None",num_gpu_blocks="262144",num_gpu_blocks_override="None"'
)
VLLM_TEXT = (
    (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        "vllm:cache_config_info{" + _INFO_LABELS + "} 1.0\n"
    )
    + """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""
)


def test_vllms_pool_metrics_are_read() -> None:
    assert pool_of(VLLM_TEXT) == PoolFacts(262144, 0.5)  # (the fullest engine of the two)


def test_no_pool_size_is_no_pool() -> None:
    assert pool_of("vllm:kv_cache_usage_perc 0.5\n") is None
    assert pool_of(VLLM_TEXT.replace('num_gpu_blocks="262144"', 'num_gpu_blocks="0"')) is None


async def test_the_emulators_pool_is_read(start_emulator: StartEmulator) -> None:
    emu = await start_emulator(num_blocks=4096)
    async with aiohttp.ClientSession() as http, http.get(emu.http_url + "/metrics") as r:
        text = await r.text()
    assert pool_of(text) == PoolFacts(4096, 0.0)

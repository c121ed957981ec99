"""The one typed settings object of an emulated vLLM engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode", "both"]
KVLoadFailurePolicy = Literal["fail", "recompute"]

ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
KV_LOAD_FAILURE_POLICIES: tuple[KVLoadFailurePolicy, ...] = ("fail", "recompute")

#: The vLLM release whose behaviour the emulator follows, as its ``/version`` says.
VLLM_VERSION = "0.32.0"

#: vLLM refuses to read remote blocks this close (seconds) to their expiry.
EXPIRY_SAFETY_MARGIN_S = 5.0


class ConfigError(ValueError):
    """An emulator setting is out of range."""


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything one emulated engine needs; parsed once, validated at start."""

    host: str = "127.0.0.1"
    """Address the OpenAI-compatible HTTP server binds to."""
    port: int = 8000
    """HTTP port; 0 picks a free one (see ``EmulatorServer.http_port``)."""
    role: Role = "both"
    """Deployment role: prefill, decode or both (reported, not enforced: what a request does
    comes from its kv_transfer_params, as with vLLM's kv_role kv_producer, kv_consumer and
    the deprecated kv_both)."""
    model: str = "kvferry/emulated-model"
    """Served model name; requests naming another model get a 404."""
    api_key: str = ""
    """vLLM's --api-key: requests to /v1/... without ``Authorization: Bearer <key>`` get a
    401 (the other routes, /health, /tokenize and /metrics among them, stay open)."""
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 4096
    """Capacity of the KV block pool."""
    max_model_len: int = 32768
    """Longest sequence (prompt + generated tokens) a request may reach."""
    engine_id: str | None = None
    """Fixed engine id; None draws a fresh uuid per start (a new engine generation)."""
    side_channel_host: str = "localhost"
    """Host the KV side channel binds to and reports as ``remote_host`` (vLLM default localhost)."""
    side_channel_port: int = 5600
    """KV side-channel port reported as ``remote_port``; 0 picks a free one."""
    kv_events_host: str = "*"
    """Interface the KV-event ZMQ sockets bind to."""
    kv_events_port: int | None = None
    """ZMQ PUB port for KV events; None disables events, 0 picks a free port."""
    kv_events_replay_port: int | None = None
    """ZMQ ROUTER port for replaying buffered event batches; None disables, 0 picks a free port."""
    kv_events_topic: str = ""
    """Topic frame of every published KV-event message."""
    kv_events_buffer_steps: int = 10_000
    """Number of past event batches kept for replay."""
    bidirectional_kv_xfer: bool = True
    """As a decoder, pin a finished request's blocks and return params so a prefiller can pull them."""
    kv_recompute_threshold: int = 64
    """As a prefiller, recompute instead of pulling when fewer tokens than this would be pulled."""
    decoder_kv_blocks_ttl: float = 480.0
    """Seconds a decoder keeps a finished request's blocks pinned for a prefiller to pull."""
    kv_abort_timeout: float = 30.0
    """Seconds a prefiller holds a request's blocks for its decoder before freeing them
    (vLLM 0.32: the NixlConnector's ``kv_lease_duration``, 30 s; releases before it:
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s)."""
    stream_kv_transfer_params: bool = False
    """A stream's final chunk carries ``kv_transfer_params`` (the change proposed in vLLM PR
    40186, issue 36308); off, as in vLLM 0.32, only non-streamed answers carry them."""
    kv_load_failure_policy: KVLoadFailurePolicy = "fail"
    """What a failed KV pull does to the request: fail it (HTTP 500) or recompute."""
    chat_prompt_token_ids: bool = True
    """A chat request's ``kv_transfer_params.prompt_token_ids`` is its prompt, templating
    skipped, as in vLLM 0.32 (vLLM PR 48145; `emulator.prompts`); False: rendered from the
    messages all the same, as in releases before it. /v1/completions never takes them."""
    enable_prefix_caching: bool = True
    """Reuse locally cached blocks across requests (and publish KV events)."""
    prefill_ms_per_token: float = 0.0
    """Simulated prefill cost per computed (not cached, not pulled) prompt token."""
    decode_ms_per_token: float = 0.0
    """Simulated cost of each decode step after the first token."""
    transfer_ms_per_block: float = 0.0
    """Simulated cost of pulling one KV block over the side channel."""
    side_channel_timeout: float = 10.0
    """Seconds a side-channel read or notify may take before it counts as failed."""
    block_wait_timeout: float = 30.0
    """Seconds a request waits for free KV blocks before failing with HTTP 503."""
    tp_size: int = 1
    """Tensor-parallel size reported in kv_transfer_params."""
    data_parallel_rank: int = 0
    """Data-parallel rank stamped on KV-event batches."""

    def validate(self) -> None:
        """Raise ConfigError when a setting is out of range."""
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}")
        if self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.num_blocks <= 0:
            raise ConfigError("num_blocks must be positive")
        if self.max_model_len <= 1:
            raise ConfigError("max_model_len must be at least 2")
        for name in ("port", "side_channel_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be a port number")
        for name in ("kv_events_port", "kv_events_replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be a port number or None")
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            raise ConfigError("kv_events_replay_port needs kv_events_port")
        if self.kv_events_buffer_steps <= 0:
            raise ConfigError("kv_events_buffer_steps must be positive")
        if self.kv_recompute_threshold < 0:
            raise ConfigError("kv_recompute_threshold must not be negative")
        for name in (
            "decoder_kv_blocks_ttl",
            "kv_abort_timeout",
            "side_channel_timeout",
            "block_wait_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in (
            "prefill_ms_per_token",
            "decode_ms_per_token",
            "transfer_ms_per_block",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative")
        if self.tp_size <= 0 or self.data_parallel_rank < 0:
            raise ConfigError("tp_size must be positive, data_parallel_rank >= 0")

    def replace(self, **changes: object) -> EmulatorConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

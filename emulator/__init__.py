"""A vLLM stand-in for machines without GPUs (tests, demos, benchmarks).

Same OpenAI HTTP API, same ``kv_transfer_params`` semantics as vLLM's NIXL
connector (including bidirectional transfer), same KV-event wire format, a
timing model, and real block contents so that wrong KV changes answers.
"""

from emulator.config import EmulatorConfig
from emulator.server import EmulatorServer

__all__ = ["EmulatorConfig", "EmulatorServer"]

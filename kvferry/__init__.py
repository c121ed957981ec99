"""kvferry: control plane for KV-cache reuse across prefill/decode vLLM nodes."""

__version__ = "0.1.0"

"""The kvferry router: an OpenAI-compatible front door for P/D vLLM deployments.

Per turn it asks the daemon whether the previous turn's KV, still held by a
decode node, can be pulled by the prefill node; sends the prompt to P with
those params, then to D (through D's sidecar, which registers the new turn's
blocks), and streams D's answer back. Without a conversation id, or whenever
the control plane cannot help in time, it serves plain P/D.

``async with Router(settings) as r:`` runs one in-process (tests, benchmarks);
``kvferry router`` runs one as a process (see ``router.cli``).
"""

from __future__ import annotations

from router.app import Router
from router.settings import Settings

__all__ = ["Router", "Settings"]

"""The kvferry sidecar: one per vLLM server.

It registers the node with the daemon and keeps it alive while the engine
answers, proxies the engine's HTTP API to capture the ``kv_transfer_params``
a decode node returns when a turn finishes (and registers them as a
retention), and forwards the engine's KV-event stream to the daemon's index.

``async with Sidecar(settings) as sc:`` runs one in-process (tests, benchmarks);
``kvferry sidecar`` runs one as a process (see ``sidecar.cli``).
"""

from __future__ import annotations

from sidecar.app import Sidecar
from sidecar.settings import Settings

__all__ = ["Settings", "Sidecar"]

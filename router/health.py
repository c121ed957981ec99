"""The router's own /health probes of the nodes it routes to (the I/O of `router.view`).

Each node is probed every `health_interval_s` at its ``url`` (its sidecar, which relays
``/health`` to the engine and answers 502 when the engine cannot be reached), one probe
in flight per node at a time: a node that hangs delays no other node's probes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import aiohttp
import structlog

from kvferry.tasks import cancel_and_wait
from router.choice import Node
from router.settings import UpstreamSettings

log = structlog.get_logger(__name__)


async def answers_health(http: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Whether ``url``/health answers 200 within `timeout_s`."""
    try:
        async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


class HealthProbes:
    """Probes `targets()` forever; each result goes to `observe(engine_id, url, ok)`."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        settings: UpstreamSettings,
        targets: Callable[[], Sequence[Node]],
        observe: Callable[[str, str, bool], None],
    ) -> None:
        self._http = http
        self._s = settings
        self._targets = targets
        self._observe = observe
        self._in_flight: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._s.health_interval_s)
                self.probe_all()
        finally:
            await cancel_and_wait(list(self._in_flight.values()))

    def probe_all(self) -> None:
        """Send a probe to every target without one in flight."""
        for node in self._targets():
            if node.engine_id not in self._in_flight:
                task = asyncio.get_running_loop().create_task(self._probe(node), name="router-health-probe")
                self._in_flight[node.engine_id] = task

    async def _probe(self, node: Node) -> None:
        try:
            ok = await answers_health(self._http, node.url, self._s.health_timeout_s)
            self._observe(node.engine_id, node.url, ok)
        except Exception:  # a background task: nothing else would see it
            log.exception("router.health.probe_error", node=node.engine_id)
        finally:
            self._in_flight.pop(node.engine_id, None)

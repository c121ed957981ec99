"""Releases of retentions replaced before any turn claimed them.

A conversation's retention is replaced by its next turn's when that turn did not claim
it (it skipped the lookup: daemon down, breaker open, a late lookup that left it alone).
D still holds those blocks, and no one will pull them: the daemon hands their params
back with the registration that replaced them, and this sidecar has a prefill node
send D the notification that frees them (`claim_release_body`, as the router releases
a late claim), rather than D holding them to its TTL. Best effort: a failure leaves them
to the TTL, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import grpc
import structlog

from kvferry.releases import claim_release_body
from kvferry.v1 import nodes_pb2
from sidecar.daemon import DaemonLink
from sidecar.metrics import SidecarMetrics
from sidecar.settings import Settings

log = structlog.get_logger(__name__)

MAX_IN_FLIGHT = 64
_TIMEOUT_S = 10.0
_PREFILLS = (nodes_pb2.PREFILL, nodes_pb2.BOTH)


class Releaser:
    """Sends each release through an alive prefill node of the same model, in the background."""

    def __init__(
        self, settings: Settings, link: DaemonLink, http: aiohttp.ClientSession, metrics: SidecarMetrics
    ) -> None:
        self._s = settings
        self._link = link
        self._http = http
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, params: Mapping[str, Any], model: str, conversation_id: str) -> None:
        """Send D `params` (a replaced retention's, remote_num_tokens 0) through a prefill
        node serving `model`, in the background."""
        if len(self._tasks) >= MAX_IN_FLIGHT:
            self._metrics.replaced_releases.labels("skipped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._send(dict(params), model, conversation_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, params: dict[str, Any], model: str, conversation_id: str) -> None:
        outcome = "failed"
        try:
            prefill = await self._prefill(model)
            if prefill is None:
                outcome = "no_prefill"
                return
            url, served = prefill
            key = self._s.engine.api_key  # (the deployment's engines share vLLM's --api-key)
            headers = {"Authorization": f"Bearer {key}"} if key else None
            async with self._http.post(
                url + "/v1/completions",
                json=claim_release_body(served or None, params),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S),
            ) as r:
                await r.read()
                outcome = "released" if r.status == 200 else "refused"
        except (aiohttp.ClientError, TimeoutError, grpc.aio.AioRpcError) as e:
            log.info("lease.release.failed", conversation_id=conversation_id, error=repr(e))
        finally:
            self._metrics.replaced_releases.labels(outcome).inc()
            log.info("lease.release", conversation_id=conversation_id, outcome=outcome)

    async def _prefill(self, model: str) -> tuple[str, str] | None:
        """(URL, model) of an alive prefill node serving `model` (its engine's own URL when
        advertised, else its sidecar's); None when there is none."""
        listed = await self._link.nodes(self._link.channel()).List(
            nodes_pb2.ListNodesRequest(), timeout=self._s.daemon.rpc_timeout_s
        )
        for n in listed.nodes:
            url = (n.engine_url or n.http_url).rstrip("/")
            if n.alive and n.role in _PREFILLS and url and (not model or n.model == model):
                return url, n.model
        return None

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

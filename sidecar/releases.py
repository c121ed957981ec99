"""Releases of retentions replaced before any turn claimed them.

A conversation's retention is replaced by its next turn's when that turn did not claim
it (it skipped the lookup: daemon down, breaker open, a late lookup that left it alone).
D still holds those blocks, and no one will pull them: the daemon hands their params
back with the registration that replaced them, and this sidecar has a prefill node
send D the notification that frees them (a release, `kvferry.releases`, as the router
releases a late claim), rather than D holding them to its TTL. Best effort: a failure leaves them
to the TTL, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import grpc
import structlog

from kvferry.releases import engine_url, release_prefill, released, send_release
from kvferry.tasks import spawn
from kvferry.v1 import nodes_pb2
from sidecar.daemon import TRANSIENT, Backoff, DaemonLink
from sidecar.metrics import SidecarMetrics
from sidecar.settings import Settings

log = structlog.get_logger(__name__)

MAX_IN_FLIGHT = 64
#: A release given up before a busy P schedules it notifies no one: wait as long as a prefill may.
_TIMEOUT_S = 60.0
_NODES_FRESH_S = 5.0  # how long a node list serves (releases come in bursts after an outage)
#: Tries at the node list, each waiting up to the RPC timeout for the daemon: a release
#: made while the daemon is away (a registration a newer turn overtook) waits for it a
#: while; then the last list known serves, however old.
_LIST_TRIES = 12


SEEN_RELEASES = 4096
"""Releases from the daemon remembered, to make each once (`ReleasesSeen`)."""


class ReleasesSeen:
    """The daemon's releases made lately, by D request. The daemon tells a release at least
    once (a replica that did not hear a peer took it offers it again; two replicas may
    hold this node's stream for a moment while it moves): a second one is dropped rather
    than sent to D through a prefill node again. Pure."""

    def __init__(self, keep: int = SEEN_RELEASES) -> None:
        self._keep = keep
        self._seen: dict[tuple[str, str, str], None] = {}  # (insertion order: oldest first)

    def first(self, conversation_id: str, params: Mapping[str, Any]) -> bool:
        """Whether this release of D request `params` is the first one seen (those without a
        request id always are: nothing tells two of them apart)."""
        request = params.get("remote_request_id")
        if not isinstance(request, str) or not request:
            return True
        key = (conversation_id, str(params.get("remote_engine_id", "")), request)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._keep:
            del self._seen[next(iter(self._seen))]
        return True


class Releaser:
    """Sends each release through an alive prefill node of the same model and block size
    (one picked at random), in the background."""

    def __init__(
        self, settings: Settings, link: DaemonLink, http: aiohttp.ClientSession, metrics: SidecarMetrics
    ) -> None:
        self._s = settings
        self._link = link
        self._http = http
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self._nodes: list[nodes_pb2.Node] = []
        self._previous: list[nodes_pb2.Node] = []
        """The list before `_nodes` (a P it lacks, the one before may have: a daemon just
        started knows only the nodes that registered since)."""
        self._listed_at = -_NODES_FRESH_S
        self._listing: asyncio.Task[None] | None = None
        """The node list on its way: a burst of releases waits for one."""

    @property
    def in_flight(self) -> int:
        """Releases on their way."""
        return len(self._tasks)

    def release(
        self,
        params: Mapping[str, Any],
        model: str,
        block_size: int,
        conversation_id: str,
        on_done: Callable[[str], None] | None = None,
    ) -> None:
        """Send D `params` (a replaced retention's, remote_num_tokens 0) through a prefill
        node serving `model` with `block_size`, in the background; `on_done` is told the
        outcome (the metric's label) when it ended."""
        if len(self._tasks) >= MAX_IN_FLIGHT:
            self._metrics.replaced_releases.labels("skipped").inc()
            if on_done is not None:
                on_done("skipped")
            return
        spawn(self._send(dict(params), model, block_size, conversation_id, on_done), self._tasks)

    async def _send(
        self,
        params: dict[str, Any],
        model: str,
        block_size: int,
        conversation_id: str,
        on_done: Callable[[str], None] | None = None,
    ) -> None:
        outcome = "failed"
        try:
            prefill = await self._prefill(model, block_size)
            if prefill is None:
                outcome = "no_prefill"
                return
            url, served = prefill
            key = self._s.engine.api_key  # (the deployment's engines share vLLM's --api-key)
            headers = {"Authorization": f"Bearer {key}"} if key else None

            async def post(body: dict[str, Any]) -> int:
                async with self._http.post(
                    url + "/v1/completions",
                    json=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S),
                ) as r:
                    await r.read()
                    return r.status

            status = await send_release(post, served or None, params)
            outcome = "released" if released(status) else "refused"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as e:  # best effort: D's TTL frees the blocks all the same
            log.info("retention.release.failed", conversation_id=conversation_id, error=repr(e))
        finally:
            self._metrics.replaced_releases.labels(outcome).inc()
            log.info("retention.release", conversation_id=conversation_id, outcome=outcome)
            if on_done is not None:
                on_done(outcome)

    async def _prefill(self, model: str, block_size: int) -> tuple[str, str] | None:
        """(URL, model) of an alive prefill node serving `model` with `block_size` (its
        engine's own URL when advertised, else its sidecar's); None when there is none."""
        if asyncio.get_running_loop().time() - self._listed_at > _NODES_FRESH_S:
            if self._listing is None or self._listing.done():
                self._listing = asyncio.ensure_future(self._list_nodes())
            await asyncio.shield(self._listing)
        node = release_prefill(self._nodes, model, block_size) or release_prefill(
            self._previous, model, block_size
        )
        return (engine_url(node), node.model) if node is not None else None

    async def _list_nodes(self) -> None:
        """List the nodes again; with the daemon away, the last list known stays (an
        error when there is none)."""
        backoff = Backoff(self._s.daemon.backoff_initial_s, self._s.daemon.backoff_max_s)
        for tried in range(1, _LIST_TRIES + 1):
            try:
                # (waiting for the channel: releases come in a burst as the daemon comes
                # back, while the channel may still be reconnecting)
                listed = await self._link.nodes(self._link.channel()).List(
                    # (the daemon's view in memory: enough to pick an alive P, and no etcd read)
                    nodes_pb2.ListNodesRequest(local_only=True),
                    timeout=self._s.daemon.rpc_timeout_s,
                    wait_for_ready=True,
                )
            except grpc.aio.AioRpcError as e:
                if tried < _LIST_TRIES and e.code() in TRANSIENT:
                    await asyncio.sleep(backoff.next())
                    continue
                if self._nodes:
                    return  # (the last list known serves)
                raise
            if self._nodes:
                self._previous = self._nodes
            self._nodes, self._listed_at = list(listed.nodes), asyncio.get_running_loop().time()
            return

    async def settled(self) -> None:
        """Until the releases on their way have ended."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in [*self._tasks, self._listing]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listing is not None:
            await asyncio.gather(self._listing, return_exceptions=True)

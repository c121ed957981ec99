"""The engines the router knows, kept fresh, and how busy each one is.

Nodes come from the daemon (``Nodes/List``, refreshed every `nodes_refresh_s`), as
the router's own view keeps them (`router.view`: the daemon's word on which nodes
exist, the router's own /health probes on which answer; `router.health`), or, when
given on the command line, are fixed: then each one's model is learned from its
``/v1/models`` unless the settings name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import structlog

from kvferry.logs import Outage
from kvferry.tasks import cancel_and_wait
from router.choice import Node
from router.daemon_client import DaemonClient
from router.health import HealthProbes
from router.settings import Settings
from router.upstream import authorization
from router.view import NodeView

log = structlog.get_logger(__name__)


class DirectRoutes:
    """Where tokenize and prefill requests go: a node's advertised engine URL, unless
    connecting to it failed in the last `retry_after_s` (a sidecar may advertise an
    engine this router cannot reach); then the node's http_url, its sidecar, which
    relays everything."""

    def __init__(self, retry_after_s: float = 60.0, clock: Any = time.monotonic) -> None:
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._failed: dict[str, float] = {}

    def url(self, node: Node) -> str:
        if not node.engine_url:
            return node.url
        failed = self._failed.get(node.engine_id)
        if failed is not None and self._clock() - failed < self._retry_after_s:
            return node.url
        return node.engine_url

    def unreachable(self, node: Node, url: str) -> bool:
        """Record that connecting to `url` failed. -> whether it was the engine URL, so the
        same request may go to the node's sidecar instead."""
        if not node.engine_url or url != node.engine_url or url == node.url:
            return False
        if node.engine_id not in self._failed:
            log.warning("router.engine_url.unreachable", node=node.engine_id, url=url, fallback=node.url)
        self._failed[node.engine_id] = self._clock()
        return True


class Load:
    """Outstanding requests per node, as this router sent them; and the nodes it could not
    connect to lately, which turns leave out while any other will do (a dead node has
    nothing outstanding, so the least loaded choice would keep picking it until the
    daemon's node list drops it: seconds)."""

    def __init__(self, down_base_s: float = 2.0, down_max_s: float = 30.0) -> None:
        self._n: dict[str, int] = {}
        self._down_base_s, self._down_max_s = down_base_s, down_max_s
        self._down: dict[str, tuple[float, int]] = {}
        """engine id -> (monotonic time until which it is left out, failures in a row)."""

    def unreachable(self, engine_id: str, now: float) -> None:
        """A request could not connect to the node: left out for 2 s, doubling each time it
        is found unreachable again after a pause (at most 30 s). Failures during a pause
        (turns that chose it before) do not lengthen it."""
        until, failures = self._down.get(engine_id, (0.0, 0))
        if now < until:
            return
        pause = min(self._down_base_s * 2 ** min(failures, 30), self._down_max_s)
        self._down[engine_id] = (now + pause, failures + 1)

    def reached(self, engine_id: str) -> None:
        self._down.pop(engine_id, None)

    def down(self, now: float) -> set[str]:
        """The nodes left out now. (One left out no longer is tried again by the next turn
        that chooses it: unreachable still, it is left out twice as long.)"""
        forgotten = [e for e, (until, _) in self._down.items() if until < now - self._down_max_s]
        for e in forgotten:  # (long past its pause: gone, or back without a word)
            del self._down[e]
        return {e for e, (until, _) in self._down.items() if until > now}

    @property
    def view(self) -> Mapping[str, int]:
        return self._n

    @contextlib.contextmanager
    def track(self, node: Node) -> Iterator[None]:
        key = node.engine_id
        self._n[key] = self._n.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._n[key] - 1
            if left:
                self._n[key] = left
            else:
                del self._n[key]


def static_nodes(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], model: str, block_size: int
) -> list[Node]:
    """Nodes given as URLs; a URL in both lists is one node of role both."""
    nodes: list[Node] = []
    for url in dict.fromkeys([*prefill_urls, *decode_urls]):
        p, d = url in prefill_urls, url in decode_urls
        role = "both" if p and d else "prefill" if p else "decode"
        nodes.append(Node(engine_id=url, role=role, url=url, model=model, block_size=block_size))
    return nodes


def base_model_of(models: Any) -> str:
    """The base model in a /v1/models answer ("" = none): the first card without a parent."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return ""
    for card in data:
        if isinstance(card, dict) and isinstance(card.get("id"), str) and not card.get("parent"):
            return str(card["id"])
    return ""


class NodeDirectory:
    """The current node list: `nodes`, the nodes to route to."""

    def __init__(self, settings: Settings, daemon: DaemonClient | None, http: aiohttp.ClientSession) -> None:
        self._s = settings
        self._daemon = daemon
        self._http = http
        n = settings.nodes
        self.static = bool(n.prefill_urls or n.decode_urls)
        self.nodes: list[Node] = (
            static_nodes(n.prefill_urls, n.decode_urls, n.model, n.block_size) if self.static else []
        )
        self.ready = asyncio.Event()
        self._outage = Outage()
        self.view = NodeView(settings.upstream.health_failures)
        """The discovered nodes as the daemon lists them and the router's probes find them."""
        self.probes = HealthProbes(http, settings.upstream, lambda: self.view.probed_nodes, self._probed)

    async def refresh(self) -> None:
        if self.static:
            if any(not n.model for n in self.nodes):
                self.nodes = [await self._learn_model(n) if not n.model else n for n in self.nodes]
        elif self._daemon is not None:
            listed = await self._daemon.list_nodes()
            if listed is not None:  # (a daemon that did not answer that: not asked again now)
                await self._daemon.refresh_routes()
            self._outage.report(
                log, listed is not None, "router.nodes.list_failed", "router.nodes.list_recovered"
            )
            if listed is not None:  # (else: the nodes as they were, while they answer their probes)
                lapsed = self.view.lapsed
                self.view.listed(listed)
                self._changed()
                if self.view.lapsed != lapsed and self.view.lapsed:
                    log.warning("router.nodes.kept_lapsed", nodes=self.view.lapsed)
        if self.nodes:
            self.ready.set()

    def _probed(self, engine_id: str, url: str, ok: bool) -> None:
        if self.view.probed(engine_id, url, ok):
            log.warning("router.nodes.health", node=engine_id, url=url, answers=ok)
            self._changed()

    def _changed(self) -> None:
        """The view changed: route to what it says now."""
        nodes = self.view.nodes
        if [n.engine_id for n in nodes] != [n.engine_id for n in self.nodes]:
            log.info(
                "router.nodes.changed",
                prefill=[n.engine_id for n in nodes if n.prefills],
                decode=[n.engine_id for n in nodes if n.decodes],
                failing=self.view.failing or None,
            )
        self.nodes = nodes

    async def _learn_model(self, node: Node) -> Node:
        try:
            auth = authorization(self._s.upstream, {})  # (vLLM with --api-key: 401 without it)
            async with self._http.get(
                node.url + "/v1/models",
                headers={"Authorization": auth} if auth else None,
                timeout=aiohttp.ClientTimeout(total=self._s.daemon.rpc_timeout_s),
            ) as r:
                model = base_model_of(await r.json()) if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.info("router.nodes.model_unknown", url=node.url, error=str(e) or type(e).__name__)
            return node
        return replace(node, model=model) if model else node

    async def run(self) -> None:
        """Refresh the list forever; probe the discovered nodes meanwhile."""
        probing = None if self.static else asyncio.create_task(self.probes.run(), name="router-health")
        try:
            while True:
                await asyncio.sleep(self._s.daemon.nodes_refresh_s)
                try:
                    await self.refresh()
                except Exception:  # keep refreshing whatever one round did
                    log.exception("router.nodes.refresh_failed")
        finally:
            await cancel_and_wait([probing])

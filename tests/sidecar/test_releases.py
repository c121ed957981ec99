"""Releases of replaced retentions: through which prefill node, and what is counted."""

from __future__ import annotations

from typing import Any

import aiohttp

from kvferry.v1 import nodes_pb2
from sidecar.metrics import SidecarMetrics
from sidecar.releases import Releaser
from sidecar.settings import DaemonSettings, EngineSettings, Settings
from tests.conftest import fake_completions


class _Link:
    """A DaemonLink whose Nodes/List answers `nodes`."""

    def __init__(self, nodes: list[nodes_pb2.Node]) -> None:
        self.listed = 0
        link = self

        class _Nodes:
            async def List(self, req: Any, **_: Any) -> nodes_pb2.ListNodesResponse:
                link.listed += 1
                return nodes_pb2.ListNodesResponse(nodes=nodes)

        self._nodes = _Nodes()

    def channel(self) -> None:
        return None

    def nodes(self, channel: Any) -> Any:
        return self._nodes


def _count(metrics: SidecarMetrics, outcome: str) -> float:
    return (
        metrics.registry.get_sample_value("kvferry_sidecar_replaced_releases_total", {"outcome": outcome})
        or 0.0
    )


async def test_a_release_goes_to_a_prefill_node_of_the_model_and_block_size() -> None:
    def node(engine_id: str, url: str, role: int = nodes_pb2.PREFILL, **kw: Any) -> nodes_pb2.Node:
        return nodes_pb2.Node(
            engine_id=engine_id,
            role=role,
            http_url=url,
            engine_url=url,
            **{"model": "m", "block_size": 16, "alive": True, **kw},
        )

    async with (
        fake_completions() as fake,
        fake_completions() as unfit,
        aiohttp.ClientSession() as http,
    ):
        url, elsewhere = fake.url, unfit.url
        nodes = [
            node("p-other", elsewhere, model="other"),
            node("p-32", elsewhere, block_size=32),
            node("d", elsewhere, role=nodes_pb2.DECODE),
            node("p-dead", elsewhere, alive=False),
            node("p", url),  # the only one that fits
        ]
        link = _Link(nodes)
        metrics = SidecarMetrics()
        settings = Settings(
            engine=EngineSettings(url="http://127.0.0.1:1", api_key="k"), daemon=DaemonSettings()
        )
        params = {"remote_request_id": "req-a", "remote_num_tokens": 0, "remote_block_ids": [[1, 2]]}
        releaser = Releaser(settings, link, http, metrics)  # type: ignore[arg-type]
        releaser.release(params, "m", 16, "c")
        await releaser.settled()
        [(body, auth)] = fake.got
        assert body["model"] == "m" and body["max_tokens"] == 1 and auth == "Bearer k"
        assert body["kv_transfer_params"]["remote_request_id"] == "req-a"
        assert body["kv_transfer_params"]["remote_num_tokens"] == 0
        assert _count(metrics, "released") == 1

        fake.status = 500
        releaser.release(params, "m", 16, "c")
        await releaser.settled()
        assert _count(metrics, "refused") == 1
        releaser.release(params, "m", 64, "c")  # no prefill node with 64-token blocks
        await releaser.settled()
        assert _count(metrics, "no_prefill") == 1
        assert link.listed == 1  # one node list served all three (fresh for a few seconds)
        assert (
            unfit.got == []
        )  # no release reached a node of another model, block size or role, or a dead one

"""Releases of replaced retentions: through which prefill node, and what is counted."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import grpc
import pytest

from kvferry.v1 import nodes_pb2
from sidecar.metrics import SidecarMetrics
from sidecar.releases import Releaser, ReleasesSeen
from sidecar.settings import DaemonSettings, EngineSettings, Settings
from tests.conftest import fake_completions
from tests.factories import d_params


class _Link:
    """A DaemonLink whose Nodes/List answers `nodes`."""

    def __init__(self, nodes: list[nodes_pb2.Node]) -> None:
        self.answer = nodes
        """What Nodes/List answers (a test may change it)."""
        self.listed = 0
        self.down = False
        """The daemon is away: List fails (as after waiting for it)."""
        link = self

        class _Nodes:
            async def List(self, req: Any, **_: Any) -> nodes_pb2.ListNodesResponse:
                link.listed += 1
                assert req.local_only  # (the daemon's view in memory serves)
                await asyncio.sleep(0.01)
                if link.down:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "daemon away"
                    )
                return nodes_pb2.ListNodesResponse(nodes=link.answer)

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


def _through_one_prefill(url: str, http: aiohttp.ClientSession) -> tuple[_Link, SidecarMetrics, Releaser]:
    """A releaser whose daemon lists one alive prefill node, serving at `url`."""
    p = nodes_pb2.Node(
        engine_id="p", role=nodes_pb2.PREFILL, model="m", block_size=16, alive=True, engine_url=url
    )
    link = _Link([p])
    metrics = SidecarMetrics()
    daemon = DaemonSettings(backoff_initial_s=0.001, backoff_max_s=0.001)  # (the tries' spacing)
    settings = Settings(engine=EngineSettings(url="http://127.0.0.1:1"), daemon=daemon)
    return link, metrics, Releaser(settings, link, http, metrics)  # type: ignore[arg-type]


async def test_a_release_while_the_daemon_is_away_tries_again_then_takes_the_last_node_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registration a newer turn overtook during a daemon outage is released then: the
    node list is tried again (each try waits for the daemon), and the last one known
    serves, however old, rather than leave D's blocks to its TTL."""
    import sidecar.releases as releases

    monkeypatch.setattr(releases, "_NODES_FRESH_S", 0.0)  # (every release lists again)
    async with fake_completions() as fake, aiohttp.ClientSession() as http:
        link, metrics, releaser = _through_one_prefill(fake.url, http)
        params = {"remote_request_id": "r", "remote_num_tokens": 0, "remote_block_ids": [[1]]}
        releaser.release(params, "m", 16, "c")
        await releaser.settled()
        link.down = True
        releaser.release(params, "m", 16, "c")
        await releaser.settled()
        assert link.listed == 1 + releases._LIST_TRIES  # tried again, each time
        assert len(fake.got) == 2 and _count(metrics, "released") == 2  # then the old list served
        fresh = Releaser(releaser._s, link, http, metrics)  # type: ignore[arg-type]
        fresh.release(params, "m", 16, "c")  # no list ever known: nowhere to send it
        await fresh.settled()
        assert _count(metrics, "failed") == 1 and len(fake.got) == 2


def test_only_params_naming_their_holder_are_released() -> None:
    from kvferry.releases import notifiable

    ok = {"remote_engine_id": "d", "remote_request_id": "r", "remote_host": "10.0.0.2", "remote_port": 5600}
    assert notifiable(ok)
    assert not notifiable({**ok, "remote_port": "5600"}) and not notifiable({**ok, "remote_port": 0})
    assert not notifiable({**ok, "remote_port": True}) and not notifiable({**ok, "remote_host": ""})
    assert not notifiable({k: v for k, v in ok.items() if k != "remote_request_id"})


async def test_a_burst_of_releases_waits_for_one_node_list() -> None:
    """Releases come in bursts (the daemon back after an outage): one List serves them all."""
    async with fake_completions() as fake, aiohttp.ClientSession() as http:
        link, metrics, releaser = _through_one_prefill(fake.url, http)
        for i in range(5):
            releaser.release({"remote_request_id": f"r{i}", "remote_num_tokens": 0}, "m", 16, "c")
        await releaser.settled()
        assert link.listed == 1 and _count(metrics, "released") == 5


async def test_a_list_without_the_prefill_node_falls_back_on_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon just started knows only the nodes registered since (its view in memory): a P
    missing from its answer is still found in the list before."""
    import sidecar.releases as releases

    monkeypatch.setattr(releases, "_NODES_FRESH_S", 0.0)  # (every release lists again)
    async with fake_completions() as fake, aiohttp.ClientSession() as http:
        link, metrics, releaser = _through_one_prefill(fake.url, http)
        params = {"remote_request_id": "r", "remote_num_tokens": 0}
        releaser.release(params, "m", 16, "c")
        await releaser.settled()
        # The restarted daemon's first answer: only D re-registered yet.
        link.answer = [
            nodes_pb2.Node(engine_id="d", role=nodes_pb2.DECODE, model="m", block_size=16, alive=True)
        ]
        releaser.release(params, "m", 16, "c")
        await releaser.settled()
        assert link.listed == 2 and _count(metrics, "released") == 2 and len(fake.got) == 2


def test_the_sidecar_makes_each_release_once() -> None:
    seen = ReleasesSeen(keep=2)
    p1: dict[str, Any] = {**d_params("d-1", 160, "turn-1"), "remote_num_tokens": 0}
    assert seen.first("c", p1)
    assert not seen.first("c", p1)  # (told twice: made once)
    assert seen.first("c", {**p1, "remote_request_id": "turn-2"})
    assert seen.first("other", p1)  # (2 kept: turn-1 of c is forgotten now)
    assert seen.first("c", p1)
    no_id = {k: v for k, v in p1.items() if k != "remote_request_id"}
    assert seen.first("c", no_id) and seen.first("c", no_id)  # (nothing tells them apart)

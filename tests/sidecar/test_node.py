"""The node at the daemon across engine restarts, sidecar stops, daemon outages and refusals."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import grpc
import pytest
import structlog.testing

from controlplane.daemon import Daemon
from emulator import EmulatorServer
from kvferry.leaseclient import LeaseStream
from kvferry.v1 import leases_pb2, nodes_pb2
from realvllm.process import free_port
from sidecar import Sidecar
from tests.conftest import Client, DaemonFactory, EtcdProcess, daemon_settings, owning
from tests.polling import eventually
from tests.sidecar.conftest import StartEmulator, StartSidecar, sidecar_settings
from tests.sidecar.helpers import chat, first_turn, prefill


async def _node(client: Client, engine_id: str) -> nodes_pb2.Node | None:
    nodes = (await client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))).nodes
    return next((n for n in nodes if n.engine_id == engine_id), None)


async def _alive_at(client: Client, engine_id: str, generation: int) -> bool:
    node = await _node(client, engine_id)
    return node is not None and node.alive and node.generation == generation


async def _d_turn(
    http: aiohttp.ClientSession, p: EmulatorServer, sc: Sidecar, conversation: str, topic: str = "ferries"
) -> dict[str, Any]:
    messages = first_turn(topic)
    p1 = await prefill(http, p.http_url, messages)
    d1 = await chat(
        http,
        sc.url,
        messages,
        {"X-Conversation-Id": conversation},
        max_tokens=8,
        kv_transfer_params=p1.params,
    )
    assert d1.status == 200 and d1.params is not None, d1.body
    return d1.params


async def _lookup(client: Client, conversation: str) -> leases_pb2.LookupResponse:
    return await client.leases.Lookup(
        leases_pb2.LookupRequest(conversation_id=conversation, prompt_tokens=10_000, peek=True)
    )


def _fixed_ports(**extra: Any) -> dict[str, Any]:
    """Emulator config with fixed ports, so that a restarted engine is found at the same address."""
    return {"port": free_port(), "side_channel_port": free_port(), **extra}


async def test_the_model_is_learned_from_an_engine_that_wants_an_api_key(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar
) -> None:
    d = await start_emulator(role="decode", api_key="sk-engine")
    sc = await start_sidecar(d, engine__api_key="sk-engine")
    await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
    node = await _node(client, sc.settings.node_id)
    assert node is not None and node.model == d.config.model


async def test_a_node_the_daemon_refuses_is_reported_with_why_and_not_failed_over(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar
) -> None:
    """A served model name the daemon refuses (control characters): INVALID_ARGUMENT, which
    any replica would answer alike. It was logged as "daemon unreachable", without the
    daemon's reason, and failed over to the next address every second."""
    d = await start_emulator(role="decode", model="bad\tmodel")
    with structlog.testing.capture_logs() as logs:
        sc = await start_sidecar(d)
        await eventually(lambda: _counted(sc, "kvferry_sidecar_attaches_total", outcome="invalid"))
    invalid = [e for e in logs if e["event"] == "node.register.invalid"]
    assert invalid and "model contains control characters" in invalid[0]["detail"]
    assert sc.metrics.value("kvferry_sidecar_attaches_total", outcome="failed") == 0
    assert await _node(client, sc.settings.node_id) is None


@dataclass
class _HeldTurn:
    """A P, a D at fixed ports with its sidecar, and one conversation's retention on D."""

    p: EmulatorServer
    d: EmulatorServer
    ports: dict[str, Any]
    sc: Sidecar


async def _one_turn_held(
    client: Client,
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    conversation: str,
) -> _HeldTurn:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    ports = _fixed_ports(role="decode")
    d = await start_emulator(**ports)
    sc = await start_sidecar(d)
    await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
    await _d_turn(http, p, sc, conversation)
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    return _HeldTurn(p, d, ports, sc)


async def test_engine_restart_seen_by_health_makes_old_retentions_node_restarted(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    held = await _one_turn_held(client, start_emulator, start_sidecar, http, "before")
    p, d, ports, sc, node_id = held.p, held.d, held.ports, held.sc, held.sc.settings.node_id
    assert (await _lookup(client, "before")).decision == leases_pb2.PULL

    await d.stop()
    await eventually(lambda: _gauge(sc, "kvferry_sidecar_engine_up", 0.0))
    await start_emulator(**ports)  # a new engine process at the same address
    await eventually(lambda: _alive_at(client, node_id, 2))
    old = await _lookup(client, "before")
    assert old.decision == leases_pb2.RECOMPUTE and old.reason == "node_restarted"
    assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="identity") == 1

    await _d_turn(http, p, sc, "after")
    assert await sc.retentions.wait_idle(5)
    assert (await _lookup(client, "after")).decision == leases_pb2.PULL


async def test_a_restarted_sidecar_keeps_its_engines_generation_and_retentions(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """The sidecar restarts (an upgrade, a crash), the engine does not: the engine's start
    time on its /metrics is the one on record, so the node keeps its generation and D's
    retentions stay good. Every restart of a sidecar made them node_restarted (no reuse,
    and D's blocks held to its TTL)."""
    held = await _one_turn_held(client, start_emulator, start_sidecar, http, "kept")
    node_id = held.sc.settings.node_id
    await held.sc.stop()

    again = await start_sidecar(held.d)
    await eventually(lambda: _counted(again, "kvferry_sidecar_node_registrations_total", outcome="ok"))
    assert await _alive_at(client, node_id, 1)
    assert (await _lookup(client, "kept")).decision == leases_pb2.PULL


async def test_an_engine_restarted_while_its_sidecar_was_down_is_a_new_generation(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    held = await _one_turn_held(client, start_emulator, start_sidecar, http, "gone")
    node_id = held.sc.settings.node_id
    await held.sc.stop()
    await held.d.stop()
    await asyncio.sleep(0.02)  # (a start time apart from the first engine's)

    await start_sidecar(await start_emulator(**held.ports))
    await eventually(lambda: _alive_at(client, node_id, 2))
    old = await _lookup(client, "gone")
    assert (old.decision, old.reason) == (leases_pb2.RECOMPUTE, "node_restarted")


async def _gauge(sc: Sidecar, name: str, value: float) -> bool:
    return sc.metrics.value(name) == value


async def test_a_new_remote_engine_id_is_a_restart_even_when_health_missed_it(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    ports = _fixed_ports(role="decode")
    d = await start_emulator(**ports)
    sc = await start_sidecar(d, engine__health_interval_s=30.0)  # too slow to notice
    node_id = sc.settings.node_id
    await eventually(lambda: _alive_at(client, node_id, 1))
    first = await _d_turn(http, p, sc, "old")
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)

    await d.stop()
    await start_emulator(**ports)
    second = await _d_turn(http, p, sc, "new")
    assert second["remote_engine_id"] != first["remote_engine_id"]
    assert await sc.retentions.wait_idle(5)
    await eventually(lambda: _alive_at(client, node_id, 2))
    assert (await _lookup(client, "old")).reason == "node_restarted"
    new = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="new"))
    assert new.generation == 2, "the new engine's retention waited for the new generation"
    assert (await _lookup(client, "new")).decision == leases_pb2.PULL
    assert sc.metrics.value("kvferry_sidecar_engine_restarts_total", signal="engine_id") == 1


async def test_a_stopped_sidecar_suspends_its_node_at_once_and_voids_nothing(
    client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """Nobody vouches for the engine process once its sidecar is gone (a pod restart takes
    both): its retentions were handed out for the whole liveness TTL after, to whatever
    process listened at D's address by then. Now the node is suspended when the sidecar's
    stream ends; a sidecar finding the same process again makes them good again."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    # (4 s: heartbeats every third of it; one seen 1.5 s late on a loaded 2-core machine
    # lapsed a 2 s TTL)
    sc = await start_sidecar(d, daemon__liveness_ttl_s=4)
    await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
    await _d_turn(http, p, sc, "conv")
    await asyncio.sleep(4.5)  # heartbeats keep a 4 s TTL alive
    assert (await _lookup(client, "conv")).decision == leases_pb2.PULL
    await sc.stop()

    async def gone() -> bool:  # (the daemon suspends it as it sees the stream end)
        answer = await _lookup(client, "conv")
        return (answer.decision, answer.reason) == (leases_pb2.RECOMPUTE, "node_gone")

    await eventually(gone, within=2)
    node = await _node(client, sc.settings.node_id)
    assert node is not None and node.suspended and not node.alive and node.generation == 1

    await start_sidecar(d)
    await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
    assert (await _lookup(client, "conv")).decision == leases_pb2.PULL


async def test_daemon_outage_leaves_traffic_alone_and_registrations_catch_up(
    make_daemon: DaemonFactory,
    etcd_endpoint: str,
    connect: Any,
    start_emulator: StartEmulator,
    http: aiohttp.ClientSession,
) -> None:
    settings = daemon_settings(etcd_endpoint)
    settings = replace(settings, server=replace(settings.server, listen=f"127.0.0.1:{free_port()}"))
    first = await make_daemon(settings)
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    async with (
        Sidecar(sidecar_settings(d, first)) as sc,
        Sidecar(sidecar_settings(p, first, engine__role="prefill")) as p_sc,
    ):
        client = connect(first)
        await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
        await eventually(lambda: _alive_at(client, p_sc.settings.node_id, 1))
        await first.stop()

        # Served all the same; and a second turn of the conversation overtakes the first's
        # registration, still waiting.
        params = await _d_turn(http, p, sc, "during-outage")
        assert params["do_remote_decode"] is True
        await eventually(lambda: _counted(sc, "kvferry_sidecar_lease_registrations_total", outcome="requeue"))
        newer = await _d_turn(http, p, sc, "during-outage", topic="harbours")
        dropped = "kvferry_sidecar_lease_registrations_dropped_total"
        await eventually(lambda: _counted(sc, dropped, reason="superseded"), within=10)
        assert sc.retentions is not None and sc.retentions.pending == 1  # the newer one, waiting

        second = await make_daemon(settings)  # same address, same etcd and prefix
        client = connect(second)
        assert await sc.retentions.wait_idle(10)
        value = sc.metrics.value
        assert value("kvferry_sidecar_lease_registrations_total", outcome="sent") == 1
        assert value("kvferry_sidecar_lease_registrations_dropped_total", reason="superseded") == 1
        await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))  # re-attached, same generation
        assert (await _lookup(client, "during-outage")).decision == leases_pb2.PULL
        lease = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="during-outage"))
        assert lease.kv_transfer_params["remote_request_id"] == newer["remote_request_id"]

        async def freed() -> bool:  # the overtaken turn's blocks, through P
            return params["remote_request_id"] not in d.engine.snapshot()["held_requests"]

        await eventually(freed, within=10)
        assert newer["remote_request_id"] in d.engine.snapshot()["held_requests"]


async def test_a_conversations_registration_waits_for_the_one_in_flight(
    client: Client,
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Turn two finishes while turn one's registration is still on its way (the daemon slow
    for it): turn two's waits, then goes. Sent together, the one landing last (turn one's
    here) was the one kept, and the newer turn's retention lost."""
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    sc = await start_sidecar(d)
    await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
    real = LeaseStream.register
    calls = 0

    async def slow_first(self: LeaseStream, req: Any, deadline_s: float) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.5)
        return await real(self, req, deadline_s)

    monkeypatch.setattr(LeaseStream, "register", slow_first)
    await _d_turn(http, p, sc, "ordered")
    newer = await _d_turn(http, p, sc, "ordered", topic="harbours")
    assert sc.retentions is not None and await sc.retentions.wait_idle(5)
    assert sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="sent") == 2
    lease = await client.leases.Get(leases_pb2.GetLeaseRequest(conversation_id="ordered"))
    assert lease.kv_transfer_params["remote_request_id"] == newer["remote_request_id"]


async def test_registrations_a_stopping_sidecar_could_not_send_are_counted(
    make_daemon: DaemonFactory,
    etcd_endpoint: str,
    connect: Any,
    start_emulator: StartEmulator,
    http: aiohttp.ClientSession,
) -> None:
    """Stopped while the daemon is away, after its grace: what was still queued is dropped
    as "shutdown", counted and logged, not lost without a trace."""
    daemon = await make_daemon(daemon_settings(etcd_endpoint))
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    sc = Sidecar(sidecar_settings(d, daemon))
    await sc.start()
    try:
        await eventually(lambda: _alive_at(connect(daemon), sc.settings.node_id, 1))
        await daemon.stop()
        await _d_turn(http, p, sc, "left-behind")
        await eventually(lambda: _counted(sc, "kvferry_sidecar_lease_registrations_total", outcome="requeue"))
    finally:
        with structlog.testing.capture_logs() as logs:
            await sc.stop(grace_s=0.2)
    dropped = "kvferry_sidecar_lease_registrations_dropped_total"
    assert sc.metrics.value(dropped, reason="shutdown") == 1
    assert sc.retentions is not None and sc.retentions.pending == 0
    assert any(e["event"] == "sidecar.stop.registrations_dropped" and e["count"] == 1 for e in logs)


async def test_a_registration_the_daemon_may_have_stored_is_not_sent_again(
    private_etcd: EtcdProcess,
    make_daemon: DaemonFactory,
    connect: Any,
    start_emulator: StartEmulator,
    start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    """The daemon got it and answered UNAVAILABLE (etcd down here; as well a write that
    timed out, which etcd may have committed): the registration is dropped, not resent. By
    the time a resend landed, the retention could have been handed out and D's blocks
    freed, and it would hand them to a second P. (The shard's ownership stays valid for the
    whole outage here, so its owner decides the registration in memory and only its write
    is not taken; one turned away undecided is sent again: test_registration_stall.)"""
    daemon = await make_daemon(owning(daemon_settings(private_etcd.endpoint), ttl_s=120, margin_s=5.0))
    client = connect(daemon)
    p = await start_emulator(role="prefill", enable_prefix_caching=False)
    d = await start_emulator(role="decode")
    sc = await start_sidecar(d, daemon)
    await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))
    await private_etcd.stop()
    await _d_turn(http, p, sc, "unsure")
    dropped = "kvferry_sidecar_lease_registrations_dropped_total"
    await eventually(lambda: _counted(sc, dropped, reason="maybe_stored"), within=20)
    await private_etcd.start()

    async def back() -> bool:
        try:
            return await _alive_at(client, sc.settings.node_id, 1)
        except grpc.aio.AioRpcError:  # the daemon reconnecting to etcd
            return False

    await eventually(back, within=20)
    assert sc.retentions is not None and sc.retentions.pending == 0
    assert sc.metrics.value("kvferry_sidecar_lease_registrations_total", outcome="requeue") == 0
    # (the daemon may store it all the same: its shard's owner had taken it in memory, and
    # writes it once etcd is back, as etcd may commit a write it timed out; the sidecar
    # keeps D's blocks for it either way, counted as maybe_stored)
    assert (await _lookup(client, "unsure")).reason in ("no_lease", "pull", "partial_pull")


async def _counted(sc: Sidecar, name: str, **labels: str) -> bool:
    return sc.metrics.value(name, **labels) > 0


async def test_refused_attach_re_registers(
    daemon: Daemon, client: Client, start_emulator: StartEmulator, start_sidecar: StartSidecar
) -> None:
    d = await start_emulator(role="decode")
    sc = await start_sidecar(d, daemon__liveness_ttl_s=2)
    node_id = sc.settings.node_id
    await eventually(lambda: _alive_at(client, node_id, 1))
    assert (await client.nodes.Deregister(nodes_pb2.DeregisterNodeRequest(engine_id=node_id))).found
    await eventually(lambda: _counted(sc, "kvferry_sidecar_attaches_total", outcome="refused"))
    # Deregistration is final for generation 1: the node comes back as generation 2.
    await eventually(lambda: _alive_at(client, node_id, 2))
    assert sc.metrics.value("kvferry_sidecar_node_registrations_total", outcome="restarted") == 1


async def test_failover_to_the_next_daemon_address(
    daemon: Daemon, client: Client, start_emulator: StartEmulator
) -> None:
    d = await start_emulator(role="decode")
    s = sidecar_settings(d, daemon)
    s = replace(s, daemon=replace(s.daemon, addresses=(f"127.0.0.1:{free_port()}", daemon.address)))
    async with Sidecar(s) as sc:
        await eventually(lambda: _alive_at(client, sc.settings.node_id, 1))


async def test_a_block_size_the_engine_did_not_say_is_asked_again_not_guessed() -> None:
    """/metrics failing once (a timeout, a 500) made the block size 16 for the engine's
    life: with larger blocks every retention was refused (too few block ids for its
    tokens). Now learning the facts fails, and is tried again; a configured size needs
    no /metrics."""
    from aiohttp import web

    from sidecar.engine import learn_facts
    from sidecar.settings import EngineSettings

    status = [500]

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text='vllm:cache_config_info{block_size="32"} 1.0\n', status=status[0])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine = EngineSettings(url=f"http://127.0.0.1:{runner.addresses[0][1]}", model="m")
    try:
        async with aiohttp.ClientSession() as http:
            try:
                await learn_facts(http, engine)
                raise AssertionError("a block size was guessed")
            except aiohttp.ClientError:
                pass
            assert (await learn_facts(http, replace(engine, block_size=64))).block_size == 64
            status[0] = 200
            assert (await learn_facts(http, engine)).block_size == 32
    finally:
        await runner.cleanup()

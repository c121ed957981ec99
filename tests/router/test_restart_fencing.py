"""D restarted under its fixed engine id faster than its sidecar's health window.

P finds D by engine id and side-channel address; with a fixed ``--engine-id`` a new
D process is the same id to a P that holds no handshake of the old one, and P reads
the new process's memory at the old block ids: a wrong answer, and wrong KV cached
on the way (sidecar/identity.py, vllm_facts Q2). No turn may pull from a D process
other than the one that registered the retention.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import aiohttp

from emulator import EmulatorServer
from kvferry.v1 import leases_pb2, nodes_pb2
from realvllm.process import free_port
from sidecar import Sidecar
from tests.polling import eventually
from tests.router.conftest import MakeStack, Reference, Stack, emulator_config, sidecar_for
from tests.router.helpers import CHAT, ask, first_turn, next_turn

#: The sidecar's health window: 3 probes a second apart (the restart is over long before).
HEALTH = {"health_interval_s": 1.0, "health_failures": 3, "health_timeout_s": 1.0}


def _fixed_d() -> dict[str, Any]:
    ports = (free_port(), free_port(), free_port(), free_port())
    return {
        "role": "decode",
        "engine_id": "d-fixed",
        "port": ports[0],
        "side_channel_port": ports[1],
        "kv_events_port": ports[2],
        "kv_events_replay_port": ports[3],
    }


async def _start_d(stack: Stack, config: dict[str, Any], tap_port: int = 0) -> EmulatorServer:
    """D with `config`, and (`tap_port` given) a sidecar listening there."""
    d = EmulatorServer(emulator_config(**config), shutdown_timeout=0.5)
    await d.start()
    stack.decodes.append(d)
    if tap_port:
        s = sidecar_for(d, stack.daemon, "decode")
        s = replace(s, engine=replace(s.engine, **HEALTH), tap=replace(s.tap, listen=f"127.0.0.1:{tap_port}"))
        sc = Sidecar(s)
        await sc.start()
        stack.sidecars[id(d)] = sc
    return d


async def _stop_d(stack: Stack, d: EmulatorServer) -> None:
    await d.stop()
    stack.decodes.remove(d)


async def _node(stack: Stack, engine_id: str) -> nodes_pb2.Node:
    nodes = (await stack.client.nodes.List(nodes_pb2.ListNodesRequest(include_dead=True))).nodes
    [node] = [n for n in nodes if n.engine_id == engine_id]
    return node


async def _turns_after_the_restart(
    stack: Stack, http: aiohttp.ClientSession, reference: Reference, d: EmulatorServer, body: dict[str, Any]
) -> None:
    """Turn two of the conversation and an unrelated one sharing its system prompt: the
    no-reuse answers, and no read of blocks the new D does not hold for the reader."""
    router = stack.routers[0]
    two = await ask(http, router.url, body)
    assert two.status == 200 and two.decision != "PULL", (two.decision, two.reason)
    assert two.text == await reference(CHAT, body)
    other = {"messages": first_turn("lighthouses"), "max_tokens": 30, "conversation_id": "other"}
    unrelated = await ask(http, router.url, other)
    assert unrelated.status == 200 and unrelated.text == await reference(CHAT, other)
    assert d.engine.snapshot()["unheld_reads"] == 0
    assert sum(e.engine.snapshot()["unheld_reads"] for e in stack.decodes) == 0


async def test_a_d_restarted_within_the_health_window_is_never_pulled_stale(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """The sidecar noticed nothing (the restart was over before a probe could fail twice,
    and the engine id stayed): the node stayed alive at its generation, the next turn was
    handed the old process's block ids, and P read the new process's memory."""
    stack = await make_stack(decode=0)
    config = _fixed_d()
    d = await _start_d(stack, config, free_port())
    sc = stack.sidecar(d)
    router = await stack.router()
    messages = first_turn("ferries")
    one = await ask(http, router.url, {"messages": messages, "max_tokens": 30, "conversation_id": "c"})
    assert one.status == 200
    await stack.registrations_idle()

    await _stop_d(stack, d)

    async def in_doubt() -> bool:  # (well within the window: its publisher went away)
        node = await _node(stack, sc.settings.node_id)
        return node.suspended or node.generation != 1

    await eventually(in_doubt, within=2.5)
    again = await _start_d(stack, config)
    stack.sidecars[id(again)] = stack.sidecars.pop(id(d))
    body = {"messages": next_turn(messages, one.text), "max_tokens": 30, "conversation_id": "c"}
    await _turns_after_the_restart(stack, http, reference, again, body)

    # The new process is registered at a new generation.
    async def registered_anew() -> bool:
        node = await _node(stack, sc.settings.node_id)
        return node.alive and node.generation == 2

    await eventually(registered_anew)
    assert sc.metrics.value("kvferry_sidecar_engine_suspensions_total", signal="kv_disconnect") >= 1


async def test_a_pod_restart_never_hands_the_old_processes_blocks_out(
    make_stack: MakeStack, http: aiohttp.ClientSession, reference: Reference
) -> None:
    """Sidecar and D restarted together: the node stayed alive for the old sidecar's
    liveness TTL, and a turn then was handed the old process's blocks, read from the new
    process as soon as it listened. Now the node is suspended as the old sidecar's stream
    ends, and its new sidecar registers the new process at a new generation."""
    stack = await make_stack(decode=0)
    config, tap_port = _fixed_d(), free_port()
    d = await _start_d(stack, config, tap_port)
    sc = stack.sidecar(d)
    router = await stack.router()
    messages = first_turn("harbours")
    one = await ask(http, router.url, {"messages": messages, "max_tokens": 30, "conversation_id": "c"})
    assert one.status == 200
    await stack.registrations_idle()

    await sc.stop()
    await _stop_d(stack, d)
    again = await _start_d(stack, config)  # listening, its sidecar not up yet

    async def not_handed_out() -> bool:  # (well within the old sidecar's 10 s liveness TTL)
        peek = await stack.client.leases.Lookup(leases_pb2.LookupRequest(conversation_id="c", peek=True))
        return (peek.decision, peek.reason) == (leases_pb2.RECOMPUTE, "node_gone")

    await eventually(not_handed_out, within=2.5)
    s = sidecar_for(again, stack.daemon, "decode")
    stack.sidecars[id(again)] = Sidecar(replace(s, tap=replace(s.tap, listen=f"127.0.0.1:{tap_port}")))
    await stack.sidecar(again).start()

    async def registered_anew() -> bool:
        node = await _node(stack, sc.settings.node_id)
        return node.alive and node.generation == 2

    await eventually(registered_anew)
    body = {"messages": next_turn(messages, one.text), "max_tokens": 30, "conversation_id": "c"}
    await _turns_after_the_restart(stack, http, reference, again, body)

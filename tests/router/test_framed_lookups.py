"""A router and sidecars given the daemon's --stream-listen address (--daemon-stream) look
up and register over the framed stream (kvferry.framedstream), not gRPC: the turn pulls as
it would over gRPC."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import pytest

from tests.conftest import DaemonFactory, daemon_settings
from tests.router.conftest import MakeStack, Reference
from tests.router.helpers import CHAT, ask, first_turn, next_turn, pulled_tokens


async def test_a_turn_pulls_through_a_framed_lookup(
    make_stack: MakeStack,
    make_daemon: DaemonFactory,
    etcd_endpoint: str,
    http: aiohttp.ClientSession,
    reference: Reference,
) -> None:
    base = daemon_settings(etcd_endpoint)
    daemon = await make_daemon(replace(base, server=replace(base.server, stream_listen="127.0.0.1:0")))
    stack = await make_stack(daemon=daemon)
    router = await stack.router(daemon__stream_addresses=(f"127.0.0.1:{daemon.stream_port}",))
    [p] = stack.prefills
    body = {"messages": first_turn("framing"), "max_tokens": 10, "conversation_id": "framed"}
    one = await ask(http, router.url, body)
    assert one.status == 200
    await stack.registrations_idle()
    second = {**body, "messages": next_turn(body["messages"], one.text)}
    before = pulled_tokens(p)
    two = await ask(http, router.url, second)
    assert (two.status, two.decision) == (200, "PULL") and two.reused > 0
    assert pulled_tokens(p) > before
    assert two.text == await reference(CHAT, second)
    # (the router's lookups and D's sidecar's registrations: one framed stream each)
    assert daemon._framed is not None and len(daemon._framed._connections) == 2


def test_one_stream_address_per_daemon_replica() -> None:
    from router.settings import DaemonSettings, Settings
    from sidecar.settings import DaemonSettings as SidecarDaemon
    from sidecar.settings import Settings as SidecarSettings

    s = Settings(daemon=DaemonSettings(addresses=("a:1", "b:1"), stream_addresses=("a:2",)))
    with pytest.raises(ValueError, match="give one per --daemon address"):
        s.validate()
    sc = SidecarSettings(daemon=SidecarDaemon(addresses=("a:1",), stream_addresses=("a:2", "b:2")))
    with pytest.raises(ValueError, match="give one per --daemon address"):
        sc.validate()

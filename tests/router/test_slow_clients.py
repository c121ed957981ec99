"""Slow and idle clients of the router's front door are timed out, as the sidecar's are
(issue 21): a head sent a byte at a time, a body that never ends, a connection that
sends nothing or stays idle after an answer. Held open, each kept a socket, and enough
of them the router's file descriptors."""

from __future__ import annotations

from controlplane.daemon import Daemon
from router import Router
from tests.rawhttp import slow_clients_are_timed_out
from tests.router.fakes import fake_engine, on_fakes


async def test_slow_heads_and_bodies_and_idle_connections_are_timed_out(daemon: Daemon) -> None:
    timeouts = {"server__head_timeout_s": 0.5, "server__body_timeout_s": 0.5, "server__idle_timeout_s": 1.0}
    async with fake_engine() as p, fake_engine() as d, Router(on_fakes(daemon, p, d, **timeouts)) as router:
        await slow_clients_are_timed_out(router.url, "/version")

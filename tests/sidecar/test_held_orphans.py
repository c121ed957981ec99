"""A registered retention whose claim reached nobody: D's sidecar asks a real daemon what
became of the D requests it registered (Leases/Held), and releases the orphan through a
P (reason unanswered); a retention still held and a freshly claimed one are not."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from controlplane.daemon import Daemon
from controlplane.service.held import HELD_GRACE_S
from kvferry.v1 import leases_pb2
from sidecar.daemon import DaemonLink
from sidecar.drafts import RetentionDraft
from sidecar.engine import EngineFacts, EngineInstance
from sidecar.metrics import SidecarMetrics
from sidecar.orphans import HELD_EVERY_S, UNANSWERED, Pin, Registered, RegisteredPins
from sidecar.retentions import RetentionSender
from sidecar.settings import DaemonSettings, EngineSettings, Settings
from tests.conftest import Client
from tests.factories import d_params, node_request
from tests.polling import eventually
from tests.sidecar.test_orphan_sender import _Releaser

HELD = "kvferry_sidecar_held_pins_total"


def _draft(conversation: str, turn: str, epoch: int = 0) -> RetentionDraft:
    """Turn `turn`'s retention on d-1 (D's request id is the turn's)."""
    return RetentionDraft(
        "", conversation, d_params("d-1", 160, turn), 160, time.time() + 300, None, "", epoch, request_id=turn
    )


async def _sender(daemon: Daemon, client: Client) -> tuple[RetentionSender, SidecarMetrics, _Releaser]:
    registered = await client.nodes.Register(node_request("d-1"), timeout=10)
    daemon_settings = DaemonSettings(addresses=(daemon.address,), rpc_timeout_s=10.0)
    settings = Settings(engine=EngineSettings(engine_id="d-1"), daemon=daemon_settings)
    metrics = SidecarMetrics()
    instance = EngineInstance(metrics)
    instance.facts = EngineFacts("m", 16)
    instance.set_generation(0, registered.node.generation)
    releaser = _Releaser()
    link = DaemonLink((daemon.address,))
    sender = RetentionSender(settings, instance, link, metrics, releaser)  # type: ignore[arg-type]
    sender.orphans.ask_after_s = 0.0  # (the daemon's grace is what keeps a fresh claim's)
    sender.orphans.held_every_s = 0.05
    return sender, metrics, releaser


async def test_the_orphan_is_released_a_held_one_and_a_fresh_claims_are_not(
    daemon: Daemon, client: Client
) -> None:
    assert daemon.control_plane is not None
    sender, metrics, releaser = await _sender(daemon, client)
    runner = asyncio.create_task(sender.run())
    try:
        for conversation in ("kept", "fresh", "lost"):
            sender.submit(_draft(conversation, f"{conversation}-1"))
        assert await sender.wait_idle(10)
        # Turn 2 of "fresh" claims its retention now; turn 2 of "lost" claimed its own
        # over the grace ago (its marker says so), and its answer reached nobody.
        lookup = leases_pb2.LookupRequest(conversation_id="fresh", prompt_tokens=1200, request_id="fresh-2")
        assert (await client.leases.Lookup(lookup, timeout=10)).claimed
        then = time.time() - HELD_GRACE_S - 5
        claimed = await daemon.control_plane.owned.claim("default", "lost", then, "lost-2")
        assert claimed.taken is not None

        async def asked_after_the_claims() -> bool:
            return metrics.value(HELD, state="claimed") >= 2 and releaser.released == ["lost-1"]

        await eventually(asked_after_the_claims, within=15)
        assert metrics.value(HELD, state="orphan") == 1
        assert metrics.value(HELD, state="retained") >= 2  # ("kept" stays retained)
        assert metrics.value("kvferry_sidecar_orphans_total", reason=UNANSWERED, action="released") == 1
        assert metrics.value("kvferry_sidecar_releases_total", reason=UNANSWERED) == 1
        assert releaser.released == ["lost-1"]  # never "kept-1" nor "fresh-1"
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def _registered(rid: str, at: float, expires_at: float = 1e12, epoch: int = 0) -> Registered:
    params = {**d_params("d-1", 160, rid), "remote_num_tokens": 0}
    return Registered(Pin(("", "c"), params, 10, expires_at, epoch, UNANSWERED), rid, at)


def test_registered_pins_are_asked_about_once_due_and_forgotten_once_settled() -> None:
    book = RegisteredPins()
    a, b, gone, old = (
        _registered("a", 100.0),
        _registered("b", 150.0),
        _registered("gone", 100.0, expires_at=120.0),
        _registered("old", 100.0, epoch=-1),
    )
    for r in (a, b, gone, old):
        book.add(r)
    # Due 120 s after its registration; D freed "gone" (its TTL), "old" went with a restart.
    assert book.due(200.0, 0, 10, ask_after_s=60.0) == [a]
    assert len(book) == 2
    assert book.answered(a, "retained", 200.0) is False
    assert book.due(200.0 + HELD_EVERY_S - 1, 0, 10, ask_after_s=60.0) == [b]  # (a was asked: it waits)
    assert book.due(240.0, 0, 10, ask_after_s=60.0) == [b, a]  # (a asked last time: after b)
    assert book.due(240.0, 0, 1, ask_after_s=60.0) == [b]  # (at most `limit`)
    assert book.answered(a, "claimed", 240.0) is False
    assert book.answered(b, "settled", 240.0) is False and len(book) == 1
    assert book.answered(a, "orphan", 300.0) is True and len(book) == 0
    assert book.answered(a, "orphan", 300.0) is False  # (once)


@pytest.mark.parametrize("how", ["replaced", "registered again"])
def test_a_pin_another_path_frees_is_not_released_on_an_old_answer(how: str) -> None:
    book = RegisteredPins()
    a = _registered("a", 100.0)
    book.add(a)
    (due,) = book.due(300.0, 0, 10)
    if how == "replaced":
        book.forget("a")
    else:
        book.add(replace(a, registered_at=250.0))
    assert book.answered(due, "orphan", 301.0) is False

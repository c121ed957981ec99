"""The daemon as an operator runs it: `kvferry daemon` with its embedded etcd,
metrics on their own port, structured logs, graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from controlplane.daemon import Daemon
from kvferry.v1 import leases_pb2_grpc
from realvllm.process import free_port
from tests.conftest import Client, DaemonFactory, daemon_settings
from tests.factories import lease_request, lookup_request, node_request

BIN = Path(sys.executable).parent


async def test_kvferry_daemon_embedded_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, metrics_port, etcd_port = free_port(), free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "kvferry"), "daemon", "--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port),
        "--data-dir", str(tmp_path / "etcd"), "--embedded-port", str(etcd_port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            resp = await health.Check(
                health_pb2.HealthCheckRequest(service="kvferry.v1.Leases"), wait_for_ready=True, timeout=30
            )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            await leases_pb2_grpc.LeasesStub(ch).Lookup(lookup_request("c"), timeout=5)
        text = await asyncio.to_thread(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            )
        )
        assert 'kvferry_lookups_total{decision="RECOMPUTE",reason="no_lease"} 1.0' in text
        assert "kvferry_etcd_seconds_bucket" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    events = [json.loads(line)["event"] for line in err.decode().splitlines() if line.startswith("{")]
    assert events[0] == "etcd.embedded.started" and "daemon.serving" in events
    assert events[-2:] == ["etcd.embedded.stopped", "daemon.stopped"], events
    assert (tmp_path / "etcd" / "member").is_dir(), "etcd data kept for the next start"


async def test_metrics_count_decisions_claims_and_registrations(
    make_daemon: DaemonFactory, connect, etcd_endpoint: str
) -> None:  # type: ignore[no-untyped-def]
    from controlplane.settings import ServerSettings

    d: Daemon = await make_daemon(
        daemon_settings(etcd_endpoint, server=ServerSettings(listen="127.0.0.1:0", metrics_port=0))
    )
    c: Client = connect(d)

    async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = await asyncio.to_thread(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5)
                .read()
                .decode()
            )
        )
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    # The counters are process-wide (other daemons of this test run count there too): deltas.
    counted = (
        ("kvferry_lookups_total", (("decision", "PULL"), ("reason", "pull"))),
        ("kvferry_lookups_total", (("decision", "RECOMPUTE"), ("reason", "already_claimed"))),
        ("kvferry_claims_total", (("kind", "pull"),)),
        ("kvferry_lease_registrations_total", (("outcome", "new"),)),
        ("kvferry_etcd_seconds_count", (("op", "claim"),)),
    )
    before = await scrape()
    await c.nodes.Register(node_request("d-1"))
    await c.leases.Register(lease_request("m-1"))
    await c.leases.Register(lease_request("m-2", engine_id="d-1", num_tokens=700))
    await c.leases.Lookup(lookup_request("m-1"))
    await c.leases.Lookup(lookup_request("m-1"))
    assert d.control_plane is not None
    await d.control_plane.owners.writes.flush()  # (the gauges read etcd: it trails the claims)
    await d.control_plane.gauges.scan()
    after = await scrape()
    deltas = [after.get(key, 0.0) - before.get(key, 0.0) for key in counted]
    # (both lookups were decided in the owner's memory: no claim is an etcd round trip)
    assert deltas == [1, 1, 1, 2, 0], dict(zip(counted, deltas, strict=True))
    node = (("engine_id", "d-1"),)
    assert after[("kvferry_live_leases", node)] == 1  # m-2: m-1 was handed out
    assert after[("kvferry_held_tokens", node)] == 700


async def test_logs_are_structured_events(client: Client) -> None:
    with structlog.testing.capture_logs() as logs:
        await client.nodes.Register(node_request("d-log"))
        await client.nodes.Register(node_request("d-log"))
    registered = [e for e in logs if e["event"] == "node.registered"]
    assert [(e["engine_id"], e["generation"], e["restarted"]) for e in registered] == [
        ("d-log", 1, False),
        ("d-log", 2, True),
    ]


def test_the_address_a_replica_advertises_to_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane import daemon

    assert daemon.advertised("127.0.0.1:0", 4321, "") == "127.0.0.1:4321"
    assert daemon.advertised("0.0.0.0:50051", 50051, "10.1.2.3:50051") == "10.1.2.3:50051"
    monkeypatch.setattr(daemon.socket, "gethostbyname", lambda name: "10.9.8.7")
    assert daemon.advertised("0.0.0.0:50051", 50051, "") == "10.9.8.7:50051"  # a container's own address
    monkeypatch.setattr(daemon.socket, "gethostbyname", lambda name: "127.0.1.1")
    assert daemon.advertised("[::]:50051", 50051, "") == ""  # loopback: no one else could reach it


@pytest.mark.parametrize(
    ("given", "announced"),
    [
        ("10.1.2.3", "10.1.2.3:50051"),  # a manifest's $(POD_IP): the listen port is added
        ("fd00::1:3", "[fd00::1:3]:50051"),  # the same on an IPv6 cluster, in brackets
        ("[fd00::1:3]", "[fd00::1:3]:50051"),
        ("[fd00::1:3]:7000", "[fd00::1:3]:7000"),
        ("daemon-0.kvferry-daemon", "daemon-0.kvferry-daemon:50051"),
        ("daemon-0.kvferry-daemon:7000", "daemon-0.kvferry-daemon:7000"),
    ],
)
def test_an_advertised_host_without_a_port_gets_the_listen_port(given: str, announced: str) -> None:
    from controlplane import daemon

    assert daemon.advertised("0.0.0.0:50051", 50051, given) == announced


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("10.1.2.3:http", "port 'http' must be 1..65535"),
        ("10.1.2.3:0", "port '0' must be 1..65535"),
        ("[fd00::1:3", "expected [IPV6] or [IPV6]:PORT"),
        ("[fd00::1:3]7000", "expected [IPV6] or [IPV6]:PORT"),
        ("[daemon-0]:7000", "'daemon-0' is not an IPv6 address"),
        ("fd00::zz", "'fd00::zz' is not an IPv6 address"),
        ("http://daemon-0:7000", "expected HOST or HOST:PORT"),
        (":7000", "expected HOST or HOST:PORT"),
    ],
)
def test_an_advertised_address_that_is_not_one_is_refused_at_start(given: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        _daemon_settings("--advertise", given)


def _daemon_settings(*argv: str) -> object:
    import argparse

    from controlplane import settings

    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return settings.from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("endpoints", "problem"),
    [
        ("10.0.0.1:2379,10.0.0.2", "etcd endpoint '10.0.0.2' must be host:port"),
        ("http://etcd-0:2379", "expected HOST or HOST:PORT, not a URL"),
        ("etcd-0:client", "port 'client' must be 1..65535"),
    ],
)
def test_etcd_endpoints_that_are_not_host_port_are_refused_at_start(endpoints: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        _daemon_settings("--etcd", endpoints)


def test_an_etcd_timeout_that_is_not_positive_is_refused_at_start() -> None:
    for value in ("0", "-1"):
        with pytest.raises(ValueError, match="etcd timeout must be positive"):
            _daemon_settings(f"--etcd-timeout={value}")


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--metrics-port", "70000"], "metrics port must be -1 (off), 0 (any) or a port, not 70000"),
        (["--metrics-port", "-5"], "metrics port must be -1 (off), 0 (any) or a port, not -5"),
        (["--embedded-port", "70000"], "embedded etcd client port 70000 is not a port"),
        (["--embedded-port", "65530"], "embedded etcd peer port 65540 is not a port"),  # (+10)
        (["--liveness-ttl", "7200"], "liveness TTL must be 2..3600 s, not 7200"),
        (["--liveness-ttl", "1"], "liveness TTL must be 2..3600 s, not 1"),
        (["--gauge-scan", "-1"], "gauge scan interval must be 0 (off) or positive"),
    ],
)
def test_settings_that_would_fail_later_are_refused_at_start(flags: list[str], problem: str) -> None:
    """(A port past 65535 made a traceback at bind, after etcd had started; a TTL past
    3600 s failed every registration that did not name its own.)"""
    with pytest.raises(ValueError, match=re.escape(problem)):
        _daemon_settings(*flags)


def test_an_owner_grace_no_longer_than_an_answers_validity_is_refused() -> None:
    """The grace before a failover releases the spent claims' blocks is what keeps a pull
    an old owner answered from racing the release (controlplane.owners): it must outlast
    the time a client may still use an answer (kvferry.limits.ANSWER_VALID_S)."""
    from dataclasses import replace

    from controlplane.settings import OwnerSettings, Settings
    from kvferry.limits import ANSWER_VALID_S

    Settings().validate()  # (the defaults hold it)
    short = replace(Settings(), owners=OwnerSettings(grace_s=ANSWER_VALID_S))
    with pytest.raises(ValueError, match="owner grace must exceed the 3 s a client may still use"):
        short.validate()

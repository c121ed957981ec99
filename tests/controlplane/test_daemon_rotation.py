"""A daemon's certificate rotated under it (cert-manager rewrites the mounted files) is
taken up by every one of its TLS ends without a restart: the mTLS port, the bearer-token
port, the framed stream's port, the channels to the other replicas, and the metrics port."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509

from controlplane.daemon import Daemon
from controlplane.settings import SecuritySettings
from kvferry.security.devca import make_dev_ca
from tests.conftest import DaemonFactory, daemon_settings
from tests.polling import eventually


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_dev_ca(out, nodes=("d0",))
    return out


def _serial(pem: Path) -> int:
    return x509.load_pem_x509_certificate(pem.read_bytes()).serial_number


def _install(certs: Path, name: str, live: Path) -> None:
    """Put `name`'s certificate and key at live/tls.pem and live/tls.key, as a rotation does."""
    for suffix in ("pem", "key"):
        shutil.copy(certs / f"{name}.{suffix}", live / f"tls.{suffix}.new")
        (live / f"tls.{suffix}.new").replace(live / f"tls.{suffix}")


async def _served(port: int, certs: Path, alpn: str | None) -> int:
    """The serial of the certificate served on `port` (the router's presented as client)."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(certs / "router.pem", certs / "router.key")
    if alpn:
        ctx.set_alpn_protocols([alpn])
    _, writer = await asyncio.wait_for(asyncio.open_connection("localhost", port, ssl=ctx), 20)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return x509.load_der_x509_certificate(der).serial_number


@pytest.fixture
async def rotating(make_daemon: DaemonFactory, etcd_endpoint: str, certs: Path, tmp_path: Path) -> Daemon:
    """A daemon serving sidecar-d0's certificate from live/ (to be rotated to daemon's)."""
    live = tmp_path / "live"
    live.mkdir()
    _install(certs, "sidecar-d0", live)
    security = SecuritySettings(
        tls_ca=certs / "ca.pem",
        tls_cert=live / "tls.pem",
        tls_key=live / "tls.key",
        policy=certs / "policy.toml",
        token_listen="127.0.0.1:0",
    )
    base = daemon_settings(etcd_endpoint)
    server = replace(base.server, metrics_port=0, stream_listen="127.0.0.1:0")
    return await make_daemon(replace(base, security=security, server=server))


async def test_both_grpc_ports_and_the_peer_channels_take_up_a_rotation(
    rotating: Daemon, certs: Path, tmp_path: Path
) -> None:
    first, rotated = _serial(certs / "sidecar-d0.pem"), _serial(certs / "daemon.pem")
    assert await _served(rotating.port, certs, "h2") == first
    assert rotating.peers is not None
    told: list[int] = []
    rotating.peers.on_rotated.append(lambda: told.append(1))
    _install(certs, "daemon", tmp_path / "live")
    assert await _served(rotating.port, certs, "h2") == rotated
    assert await _served(rotating.token_port, certs, "h2") == rotated

    async def peers_rotated() -> bool:
        return bool(told)

    await eventually(peers_rotated, within=20)


@pytest.mark.parametrize("port", ["metrics_port", "stream_port"])
async def test_the_metrics_and_framed_stream_ports_take_up_a_rotation(
    rotating: Daemon, certs: Path, tmp_path: Path, port: str
) -> None:
    first, rotated = _serial(certs / "sidecar-d0.pem"), _serial(certs / "daemon.pem")
    assert await _served(getattr(rotating, port), certs, None) == first
    _install(certs, "daemon", tmp_path / "live")

    async def port_rotated() -> bool:
        return await _served(getattr(rotating, port), certs, None) == rotated

    await eventually(port_rotated, within=30, interval=0.5)


async def test_a_silent_connection_does_not_stop_the_metrics_port(rotating: Daemon, certs: Path) -> None:
    """A client that connects to the metrics port and sends nothing (no TLS hello): the
    scrapes after it are answered all the same (the handshake was the accepting thread's,
    so one such connection stopped every scrape until it went)."""
    _, silent = await asyncio.open_connection("127.0.0.1", rotating.metrics_port)
    try:
        assert await _served(rotating.metrics_port, certs, None) == _serial(certs / "sidecar-d0.pem")
    finally:
        silent.close()

"""A second daemon on a machine where one runs on the embedded etcd: each clash is refused
at once, naming every flag a second daemon needs (following one hint used to lead to a
30 s wait and then the next clash)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.daemon import Daemon
from controlplane.settings import EtcdSettings, ServerSettings, Settings
from realvllm.process import free_port

ALL_FLAGS = ("--embedded-port", "--data-dir", "--listen")


def _settings(data_dir: Path, listen_port: int) -> Settings:
    client = free_port()
    return Settings(
        etcd=EtcdSettings(data_dir=data_dir, embedded_client_port=client, embedded_peer_port=free_port()),
        server=ServerSettings(listen=f"127.0.0.1:{listen_port}", metrics_port=-1, grace_s=0.5),
    )


@pytest.fixture
async def first(tmp_path: Path) -> AsyncIterator[Daemon]:
    d = Daemon(_settings(tmp_path / "one" / "etcd", free_port()))
    await d.start()
    yield d
    await d.stop()


async def _refused(settings: Settings) -> str:
    second = Daemon(settings)
    started = time.monotonic()
    with pytest.raises(OSError) as e:
        await second.start()
    await second.stop()
    assert time.monotonic() - started < 20  # (no wait on an etcd that cannot come up)
    message = str(e.value)
    assert all(flag in message for flag in ALL_FLAGS), message
    return message


async def test_the_same_grpc_port_is_refused_before_any_etcd_starts(first: Daemon, tmp_path: Path) -> None:
    message = await _refused(_settings(tmp_path / "two" / "etcd", first.port))
    assert f"cannot listen on 127.0.0.1:{first.port}" in message


async def test_the_same_data_directory_is_refused(first: Daemon) -> None:
    message = await _refused(_settings(first.settings.etcd.data_dir, free_port()))
    assert "data directory" in message


async def test_the_same_embedded_port_is_refused(first: Daemon, tmp_path: Path) -> None:
    clash = replace(
        _settings(tmp_path / "two" / "etcd", free_port()).etcd,
        embedded_client_port=first.settings.etcd.embedded_client_port,
    )
    message = await _refused(replace(_settings(tmp_path, free_port()), etcd=clash))
    assert f"embedded etcd port {first.settings.etcd.embedded_client_port} is in use" in message

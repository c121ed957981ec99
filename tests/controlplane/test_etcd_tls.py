"""TLS to an external etcd (issue 21, item 1): a real etcd that requires client
certificates (--client-cert-auth), and a daemon speaking to it with --etcd-ca,
--etcd-cert and --etcd-key; without the certificate, or in plaintext, nothing gets in.
The certificates come from the development CA (`kvferry certs`)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from controlplane import settings
from controlplane.daemon import Daemon
from controlplane.embedded import etcd_binary
from controlplane.errors import StoreUnavailable
from controlplane.etcd import EtcdTls
from controlplane.records import Keys
from controlplane.settings import Settings
from controlplane.store import EtcdStore
from kvferry.security.devca import make_dev_ca
from kvferry.v1 import nodes_pb2
from realvllm.process import free_port, stop_child
from tests.conftest import Client, DaemonFactory, daemon_settings, wait_port
from tests.factories import node_request
from tests.polling import eventually


@dataclass
class TlsEtcd:
    endpoint: str
    certs: Path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_dev_ca(out)
    make_dev_ca(out / "other")  # (another CA: what etcd must not trust)
    return out


@pytest.fixture
async def tls_etcd(tmp_path: Path, certs: Path) -> AsyncIterator[TlsEtcd]:
    """An etcd serving clients over TLS only to holders of a certificate of the dev CA."""
    client, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{client}"
    cmd = [
        str(etcd_binary()),
        "--name=tls",
        f"--data-dir={tmp_path / 'etcd'}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=tls=http://127.0.0.1:{peer}",
        f"--cert-file={certs / 'etcd.pem'}",
        f"--key-file={certs / 'etcd.key'}",
        f"--trusted-ca-file={certs / 'ca.pem'}",
        "--client-cert-auth",
        "--log-level=warn",
    ]
    with open(tmp_path / "etcd.log", "ab") as out:  # noqa: ASYNC230 - once, at start-up
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    try:
        await wait_port(client)
        yield TlsEtcd(f"127.0.0.1:{client}", certs)
    finally:
        await stop_child(proc, 10)


def _settings(etcd: TlsEtcd, name: str = "daemon", ca: str = "ca") -> Settings:
    s = daemon_settings(etcd.endpoint)
    c = etcd.certs
    return replace(s, etcd=replace(s.etcd, ca=c / f"{ca}.pem", cert=c / f"{name}.pem", key=c / f"{name}.key"))


async def _store(etcd: TlsEtcd, tls: EtcdTls | None) -> EtcdStore:
    store = EtcdStore((etcd.endpoint,), Keys("/tls-test"), 2.0, 60, 100, 60, tls)
    await store.connect()
    return store


async def test_the_daemon_works_over_etcd_tls(
    tls_etcd: TlsEtcd, make_daemon: DaemonFactory, connect: Callable[[Daemon], Client]
) -> None:
    d = await make_daemon(_settings(tls_etcd))
    client = connect(d)
    reply = await client.nodes.Register(node_request("d-tls"), timeout=10)
    assert reply.node.generation >= 1
    listed = await client.nodes.List(nodes_pb2.ListNodesRequest(), timeout=10)
    assert [n.engine_id for n in listed.nodes] == ["d-tls"]


@pytest.mark.parametrize(
    ("tls", "why"),
    [
        (None, "plaintext"),
        ("no-cert", "no client certificate"),
        ("other-ca", "a certificate of another CA"),
    ],
)
async def test_etcd_lets_nobody_else_in(tls_etcd: TlsEtcd, tls: str | None, why: str) -> None:
    c = tls_etcd.certs
    files = {
        None: None,
        "no-cert": EtcdTls(c / "ca.pem"),
        "other-ca": EtcdTls(c / "ca.pem", c / "other" / "daemon.pem", c / "other" / "daemon.key"),
    }[tls]
    store = await _store(tls_etcd, files)
    try:
        with pytest.raises(StoreUnavailable, match="etcd ready: UNAVAILABLE"):
            await store.ready(timeout_s=1.0)
    finally:
        await store.close()


async def test_a_rotated_client_certificate_is_taken_up(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    """cert-manager rewrites the files: the next calls go on a channel with the new ones."""
    c = tls_etcd.certs
    for name in ("ca.pem", "daemon.pem", "daemon.key"):
        shutil.copy(c / name, tmp_path / name)
    tls = EtcdTls(tmp_path / "ca.pem", tmp_path / "daemon.pem", tmp_path / "daemon.key")
    store = await _store(tls_etcd, tls)
    follow = asyncio.create_task(store.follow_certs(0.05))
    try:
        await store.ready(timeout_s=10.0)
        before = store._client.channel
        with capture_logs() as logs:
            for suffix in (".pem", ".key"):  # (another certificate of the same CA)
                shutil.copy(c / f"router{suffix}", tmp_path / f"daemon{suffix}")

            async def moved() -> bool:
                return store._client.channel is not before

            await eventually(moved, within=10)
        assert any(e["event"] == "etcd.tls.reloaded" for e in logs)
        await store.ready(timeout_s=10.0)
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        await store.close()


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--etcd-cert", "{c}/daemon.pem"],
            "etcd client certificate needs both --etcd-cert and --etcd-key: --etcd-key is missing",
        ),
        (
            ["--etcd-key", "{c}/daemon.key"],
            "etcd client certificate needs both --etcd-cert and --etcd-key: --etcd-cert is missing",
        ),
        (
            ["--etcd-cert", "{c}/daemon.pem", "--etcd-key", "{c}/daemon.key"],
            "--etcd-cert/--etcd-key need --etcd-ca: the CA of etcd's server certificate",
        ),
        (["--etcd-ca", "{c}/ca.pem"], "--etcd-ca is for an external etcd: give its endpoints with --etcd"),
        (["--etcd", "e:2379", "--etcd-ca", "{c}/nowhere.pem"], "--etcd-ca {c}/nowhere.pem: no such file"),
    ],
)
def test_etcd_tls_flags_are_checked(certs: Path, flags: list[str], error: str) -> None:
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    with pytest.raises(ValueError) as info:
        settings.from_args(p.parse_args([f.format(c=certs) for f in flags])).load_files()
    assert str(info.value) == error.format(c=certs)

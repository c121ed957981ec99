"""The daemon's security flags are checked at start (issue 21): plaintext stays on
loopback unless --insecure, TLS files come all three, a policy must load, the token port
needs TLS and a policy, the framed stream's port (--stream-listen) TLS off loopback. Each
refusal says which flag to give."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from controlplane import settings
from controlplane.daemon import Daemon
from kvferry.security.devca import make_dev_ca
from tests.conftest import daemon_settings


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_dev_ca(out)
    (out / "bad.toml").write_text('[identities.x]\nrole = "king"\n')
    return out


def _parse(flags: list[str]) -> settings.Settings:
    """As `kvferry daemon` takes them: parsed, checked, and the files they name read."""
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    s = settings.from_args(p.parse_args(flags))
    s.load_files()
    return s


def test_parsing_reads_no_files() -> None:
    """(deploy/'s manifests name files mounted in the pod: their flags parse anywhere)"""
    p = argparse.ArgumentParser()
    settings.add_arguments(p)
    tls = ["--tls-ca", "/nowhere/ca", "--tls-cert", "/nowhere/c", "--tls-key", "/nowhere/k"]
    s = settings.from_args(p.parse_args(["--listen", "0.0.0.0:1", *tls, "--policy", "/nowhere/p"]))
    with pytest.raises(ValueError, match="TLS file /nowhere/ca: No such file or directory"):
        s.load_files()


def test_development_mode_needs_nothing() -> None:
    s = _parse([])
    assert s.security.tls_files() is None and s.security.access_policy() is None


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--listen", "0.0.0.0:50051"],
            "--listen 0.0.0.0:50051 is not a loopback address and no TLS is configured: give --tls-ca, "
            "--tls-cert and --tls-key (see `kvferry certs`), or --insecure to serve plaintext anyway",
        ),
        (
            ["--tls-ca", "{c}/ca.pem", "--tls-cert", "{c}/daemon.pem"],
            "TLS needs --tls-ca, --tls-cert and --tls-key together; missing --tls-key",
        ),
        (
            ["--policy", "{c}/bad.toml"],
            "{c}/bad.toml: identities.x.role must be one of ['admin', 'reader', 'router', "
            "'sidecar', 'daemon']",
        ),
        (
            ["--policy", "{c}/policy.toml", "--token-listen", "127.0.0.1:0"],
            "--token-listen needs TLS (--tls-ca, --tls-cert, --tls-key) and --policy",
        ),
        (["--node-networks", "10.0.0.0/8,nonsense"], "node network 'nonsense' is not a CIDR"),
        (
            ["--stream-listen", "0.0.0.0:50053"],
            "--stream-listen 0.0.0.0:50053 is not a loopback address and no TLS is configured",
        ),
    ],
)
def test_refusals_say_what_to_give(certs: Path, flags: list[str], error: str) -> None:
    with pytest.raises(ValueError) as info:
        _parse([f.format(c=certs) for f in flags])
    assert str(info.value).startswith(error.format(c=certs))


def test_insecure_is_allowed_and_said(certs: Path) -> None:
    s = _parse(["--listen", "0.0.0.0:50051", "--insecure", "true"])
    assert s.security.insecure
    tls = [
        "--tls-ca",
        f"{certs}/ca.pem",
        "--tls-cert",
        f"{certs}/daemon.pem",
        "--tls-key",
        f"{certs}/daemon.key",
    ]
    s = _parse(["--listen", "0.0.0.0:50051", *tls, "--policy", f"{certs}/policy.toml"])
    assert s.security.tls_files() is not None and s.security.access_policy() is not None


async def test_an_insecure_daemon_warns_once(etcd_endpoint: str) -> None:
    base = daemon_settings(etcd_endpoint)
    s = replace(
        base,
        server=replace(base.server, listen="0.0.0.0:0"),
        security=replace(base.security, insecure=True),
    )
    with capture_logs() as logs:
        d = Daemon(s)
        try:
            await d.start()
        finally:
            await d.stop()
    assert [e["event"] for e in logs if e["event"].startswith("daemon.")].count("daemon.insecure") == 1

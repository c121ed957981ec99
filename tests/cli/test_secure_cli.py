"""The operator's commands against a daemon that lets no one in: `kvferry certs` writes
what the secure mode needs in one command, and `kvferry nodes/leases` reach the daemon
with a client certificate or a bearer token (flag or $KVFERRY_TOKEN)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.daemon import Daemon
from controlplane.settings import SecuritySettings
from kvferry.security.policy import load_policy
from kvferry.security.roles import Role
from tests.cli.test_operator_tools import run
from tests.conftest import DaemonFactory, daemon_settings

KVFERRY = sys.executable  # (as `-m kvferry_cli`: this tree's code, whatever is installed)


@pytest.fixture
async def certs(tmp_path: Path) -> Path:
    out = tmp_path / "certs"
    code, stdout, err = await run(
        KVFERRY, "-m", "kvferry_cli", "certs", "--out", str(out), "--node", "d0", "--host", "daemon.example"
    )
    assert code == 0, err
    assert f"policy: {out / 'policy.toml'}" in stdout
    return out


@pytest.fixture
async def secure(make_daemon: DaemonFactory, etcd_endpoint: str, certs: Path) -> Daemon:
    security = SecuritySettings(
        tls_ca=certs / "ca.pem",
        tls_cert=certs / "daemon.pem",
        tls_key=certs / "daemon.key",
        policy=certs / "policy.toml",
        token_listen="127.0.0.1:0",
    )
    return await make_daemon(replace(daemon_settings(etcd_endpoint), security=security))


async def test_certs_writes_a_ca_a_certificate_per_part_and_a_policy(certs: Path) -> None:
    for name in ("ca", "daemon", "router", "admin", "reader", "etcd", "sidecar-d0"):
        assert (certs / f"{name}.pem").is_file() and (certs / f"{name}.key").is_file()
    assert (certs / "daemon.key").stat().st_mode & 0o077 == 0, "keys are the owner's only"
    policy = load_policy(certs / "policy.toml")
    assert policy.identities["sidecar-d0"].role is Role.SIDECAR
    assert policy.identities["sidecar-d0"].node == "d0"
    assert policy.by_token((certs / "admin.token").read_text().strip()) is not None


async def test_the_cli_with_a_certificate(secure: Daemon, certs: Path) -> None:
    tls = ["--tls-ca", str(certs / "ca.pem")]
    admin = [*tls, "--tls-cert", str(certs / "admin.pem"), "--tls-key", str(certs / "admin.key")]
    code, out, err = await run(
        KVFERRY, "-m", "kvferry_cli", "nodes", "ls", "--json", "--daemon", secure.address, *admin
    )
    assert code == 0 and out == "", err  # (admitted; no node registered yet)
    # Without a certificate the main port lets nothing through: the daemon is unreachable.
    code, _, err = await run(
        KVFERRY, "-m", "kvferry_cli", "nodes", "ls", "--daemon", secure.address, *tls, "--timeout", "3"
    )
    assert code == 1 and "UNAVAILABLE" in err
    # A reader may list, not deregister: a refusal is the caller's (exit 2) and says why.
    reader = [*tls, "--tls-cert", str(certs / "reader.pem"), "--tls-key", str(certs / "reader.key")]
    code, _, err = await run(
        KVFERRY, "-m", "kvferry_cli", "nodes", "rm", "d0", "--daemon", secure.address, *reader
    )
    assert code == 2
    assert err.strip() == (
        "error: PERMISSION_DENIED: identity 'reader' (role reader) may not call "
        "/kvferry.v1.Nodes/Deregister: it needs role admin"
    )


async def test_the_cli_with_a_bearer_token(secure: Daemon, certs: Path) -> None:
    """The token port: the CA and a bearer token, by flag or from $KVFERRY_TOKEN."""
    tls = ["--tls-ca", str(certs / "ca.pem")]
    token = (certs / "admin.token").read_text().strip()
    token_port = f"127.0.0.1:{secure.token_port}"
    code, out, err = await run(
        KVFERRY,
        "-m",
        "kvferry_cli",
        "leases",
        "ls",
        "--all-tenants",
        "--json",
        "--daemon",
        token_port,
        *tls,
        "--token",
        token,
    )
    assert code == 0, err
    os.environ["KVFERRY_TOKEN"] = "not-the-token"
    try:
        code, _, err = await run(
            KVFERRY, "-m", "kvferry_cli", "nodes", "rm", "d0", "--json", "--daemon", token_port, *tls
        )
    finally:
        del os.environ["KVFERRY_TOKEN"]
    assert code == 2 and "UNAUTHENTICATED: no identity: the bearer token is not one of the policy's" in err
    code, out, err = await run(
        KVFERRY,
        "-m",
        "kvferry_cli",
        "nodes",
        "rm",
        "d0",
        "--json",
        "--daemon",
        token_port,
        *tls,
        "--token",
        token,
    )
    assert code == 2 and json.loads(out) == {"found": False}  # (admitted: there is no node d0)


async def test_tls_flags_that_do_not_go_together(certs: Path) -> None:
    code, _, err = await run(
        KVFERRY, "-m", "kvferry_cli", "nodes", "ls", "--tls-cert", str(certs / "admin.pem")
    )
    assert code == 2 and err.strip() == "error: --tls-cert and --tls-key go together"
    code, _, err = await run(
        KVFERRY, "-m", "kvferry_cli", "nodes", "ls", "--tls-ca", str(certs / "nowhere.pem")
    )
    assert code == 2 and err.strip() == f"error: --tls-ca {certs / 'nowhere.pem'}: No such file or directory"

"""The compose file's and the systemd units' TLS files against their identities: each
process reads the certificate `kvferry certs` makes for it, valid for the names its
callers dial (issue 21; the Kubernetes side is test_security.py)."""

from __future__ import annotations

from urllib.parse import urlsplit

from tests.deploy.manifests import PROCESSES


def _option(argv: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")]


def test_compose_certificates_are_the_ones_its_certs_service_makes() -> None:
    """Each compose process reads the development CA's file of its identity, and the CA
    names every host the others dial and every engine a sidecar registers."""
    processes = {p.where.split(":")[1]: p for p in PROCESSES if p.where.startswith("compose.yaml:")}
    certs = processes.pop("certs")
    hosts, nodes = set(_option(certs.argv, "host")), set(_option(certs.argv, "node"))
    sidecars = 0
    for name, process in processes.items():
        if process.kind == "emulate":
            continue
        identity = {"daemon": "daemon", "router": "router"}.get(
            process.kind, f"sidecar-{process.value('engine-id')}"
        )
        assert process.value("tls-cert") == f"/etc/kvferry/certs/{identity}.pem", name
        assert process.value("tls-key") == f"/etc/kvferry/certs/{identity}.key", name
        assert process.value("tls-ca") == "/etc/kvferry/certs/ca.pem", name
        if process.kind in ("sidecar", "router"):
            assert (process.value("daemon") or "").rsplit(":", 1)[0] in hosts, name
        if process.kind == "sidecar":
            assert process.value("engine-id") in nodes, name
            assert urlsplit(process.value("advertise-url") or "").hostname in hosts, name
            sidecars += 1
    assert sidecars == 2


def test_the_systemd_sidecar_speaks_for_its_instance() -> None:
    (sidecar,) = [p for p in PROCESSES if p.where == "kvferry-sidecar@.service"]
    assert sidecar.value("engine-id") == "decode0"  # the instance's name
    assert (sidecar.value("tls-cert") or "").endswith("/sidecar-decode0.pem")
    assert (sidecar.value("tls-key") or "").endswith("/sidecar-decode0.key")

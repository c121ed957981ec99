"""deploy/ against the code it deploys: every command line, KVFERRY_* variable and
metric there must be one this checkout has. A manifest that sets a misspelt variable
runs with the flag's default and says nothing (the processes now log a warning, but
only at run time, in the cluster); an alert on a renamed metric never fires."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

import controlplane.metrics  # noqa: F401 - registers the daemon's metrics in the default registry
from controlplane import settings as daemon_settings
from controlplane.policy import Reason
from emulator import cli as emulator_cli
from kvferry import flags
from kvferry.security.devca import make_dev_ca
from kvferry_cli import command as kvferry_cli
from router import cli as router_cli
from router import settings as router_settings
from router.decisions import Skip
from router.metrics import RouterMetrics
from sidecar import cli as sidecar_cli
from sidecar import settings as sidecar_settings
from sidecar.metrics import SidecarMetrics
from tests.deploy.manifests import (
    DEPLOY,
    FILE_FLAGS,
    PROCESSES,
    Process,
    container_env,
    data_of,
    volume_of,
)

_SECRET = "kvferry-router-clients"


def _policy_text(process: Process) -> str:
    """The policy file a process is given: a Kubernetes one's from its ConfigMap or Secret;
    elsewhere (files `kvferry certs` or the operator writes) the Kubernetes one of its kind."""
    path = process.value("policy")
    assert path is not None
    if process.pod is not None:
        _, volume = volume_of(process, path)
        source = volume.get("configMap") or volume.get("secret") or {}
        return data_of(source.get("name") or source["secretName"])[Path(path).name]
    return data_of(_SECRET if process.kind == "router" else "kvferry-policy")["policy.toml"]


#: Which file of a development CA stands for each file flag's.
_DEV_FILES = {"ca": "ca.pem", "cert": "daemon.pem", "key": "daemon.key"}


def _with_files(process: Process, tmp: Path) -> Process:
    """`process` with every file it names made in `tmp` (the settings read them): a
    development CA's certificates and keys, and the policy the deploy files give."""
    make_dev_ca(tmp / "ca")
    env = dict(process.env)
    argv = list(process.argv)
    for flag in FILE_FLAGS:
        path = process.value(flag)
        if not path:
            continue
        made = tmp / f"{flag}-{Path(path).name}"
        if flag == "policy":
            made.write_text(_policy_text(process))
        else:
            made.write_bytes((tmp / "ca" / _DEV_FILES[flag.split("-")[1]]).read_bytes())
        argv = [a.replace(path, str(made)) if a.startswith(f"--{flag}") or a == path else a for a in argv]
        env = {k: (str(made) if v == path else v) for k, v in env.items()}
    return Process(process.where, argv, env, process.pod, process.container, process.workload)


def test_label_values_are_read_off_the_code() -> None:
    assert KNOWN_VALUES["kvferry_router_stage_seconds_bucket", "stage"] == {
        "tokenize", "digests", "lookup", "prefill", "decode_start"
    }  # fmt: skip
    assert KNOWN_VALUES["kvferry_router_digest_blocks_total", "how"] == {"reused", "hashed"}


def test_pods_get_no_service_variables() -> None:
    """Kubernetes' service links would read as kvferry's variables, or vLLM's (VLLM_PORT)."""
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                assert doc["spec"]["template"]["spec"]["enableServiceLinks"] is False, path.name


def test_every_deploy_file_starts_kvferry_processes() -> None:
    found = {Path(p.where.split(":")[0]).name for p in PROCESSES}
    expected = {"daemon.yaml", "router.yaml", "vllm-decode.yaml", "vllm-prefill.yaml", "compose.yaml"}
    expected |= {p.name for p in DEPLOY.glob("systemd/*.service")}
    assert found == expected
    kinds = {p.argv[0] for p in PROCESSES}
    assert kinds == {"daemon", "sidecar", "router", "emulate", "certs"}


def _settings_of(
    argv: list[str],
) -> tuple[Callable[[], argparse.ArgumentParser], Callable[[argparse.Namespace], Any], str | None]:
    """(parser, settings from parsed args, variable prefix) of the process `argv` starts."""
    kind = argv[0]
    if kind == "daemon":
        return kvferry_cli.build_parser, daemon_settings.from_args, daemon_settings.ENV_PREFIX
    if kind == "sidecar":
        return sidecar_cli.build_parser, sidecar_settings.from_args, sidecar_settings.ENV_PREFIX
    if kind == "router":
        return router_cli.build_parser, router_settings.from_args, router_settings.ENV_PREFIX
    if kind == "emulate":
        return emulator_cli.build_parser, emulator_cli.config_from_args, None
    if kind == "certs":  # compose's one-shot development CA: a command of the kvferry CLI
        return kvferry_cli.build_parser, lambda args: args, None
    raise AssertionError(f"{argv}: not a process deploy/ should start")


@pytest.mark.parametrize("process", PROCESSES, ids=[p.where for p in PROCESSES])
def test_the_flags_and_variables_are_this_versions(
    process: Process, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    process = _with_files(process, tmp_path)
    for name in [n for n in os.environ if n.startswith("KVFERRY_")]:
        monkeypatch.delenv(name)
    for name, value in process.env.items():
        monkeypatch.setenv(name, value)
    build, settings_from, prefix = _settings_of(process.argv)
    # flags read their variables when the parser is built
    argv = process.argv if process.argv[0] in ("daemon", "certs") else process.argv[1:]
    try:
        args = build().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{process.where}: kvferry {shlex.join(process.argv)} does not parse")
    if prefix is None:
        assert not [n for n in process.env if n.startswith("KVFERRY_")], "the emulator reads no variables"
    else:
        assert flags.unknown_variables(prefix, args, process.env) == []
    settings_from(args)  # and the values are valid settings (raises otherwise)


# -- metrics named in alerts and dashboards -------------------------------------------------------


def _families(registry: CollectorRegistry) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(name, type, label names) of the registry's kvferry metrics (prometheus_client lists
    label names nowhere public)."""
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase) and collector._name.startswith("kvferry_"):
            yield collector._name, collector._type, tuple(collector._labelnames)


def _exposed() -> dict[str, tuple[str, ...]]:
    """Every sample name kvferry's processes expose -> its label names."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    out = {}
    for registry in (REGISTRY, RouterMetrics().registry, SidecarMetrics().registry):
        for name, kind, labels in _families(registry):
            for suffix in suffixes[kind]:
                out[name + suffix] = labels + (("le",) if suffix == "_bucket" else ())
    return out


def _labels_in_source(attribute: str) -> set[str]:
    """The literal values the router's code gives `metrics.<attribute>.labels(...)`."""
    source = "".join(p.read_text() for p in (DEPLOY.parent / "router").glob("*.py"))
    return set(re.findall(rf"\.{attribute}\.labels\(\"(\w+)\"\)", source))


#: The daemon's calls that name an etcd request for kvferry_etcd_seconds{op} (their first argument).
_ETCD_OP_CALLS = {"read", "range", "txn", "send_txn", "grant", "submit", "timed"}


def _etcd_ops_in_source() -> set[str]:
    """The literal op names the daemon's code gives its etcd calls (the histogram's `op`)."""
    ops = set()
    for path in (DEPLOY.parent / "controlplane").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func, first = node.func, node.args[0]
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _ETCD_OP_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                ops.add(first.value)
    return ops


KNOWN_VALUES = {
    ("kvferry_etcd_seconds_bucket", "op"): _etcd_ops_in_source(),
    ("kvferry_router_stage_seconds_bucket", "stage"): _labels_in_source("stage"),
    ("kvferry_router_digest_blocks_total", "how"): _labels_in_source("digest_blocks"),
    ("kvferry_lookups_total", "decision"): {"PULL", "RECOMPUTE"},
    ("kvferry_lookups_total", "reason"): {r.value for r in Reason},
    ("kvferry_router_lookups_total", "decision"): {"PULL", "RECOMPUTE", "SKIPPED"},
    ("kvferry_router_lookups_total", "reason"): {r.value for r in Reason} | {s.value for s in Skip},
}

_SELECTOR = re.compile(r"\b(kvferry_[a-z_]+)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


#: Exporters other than kvferry whose metrics the deployment's alerts watch (its
#: certificates, its etcd): their names are theirs, not this checkout's to check.
_OTHER_EXPORTERS = re.compile(r"\b(certmanager|etcd)_[a-z_]+")


def _expressions() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())["groups"]:
        for rule in group["rules"]:
            if not _OTHER_EXPORTERS.search(rule["expr"]):
                yield f"alert {rule['alert']}", rule["expr"]
    for panel in json.loads((DEPLOY / "grafana" / "kvferry.json").read_text())["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]


EXPRESSIONS = list(_expressions())


@pytest.mark.parametrize(
    ("where", "expr"), EXPRESSIONS, ids=[f"{w} {i}" for i, (w, _) in enumerate(EXPRESSIONS)]
)
def test_alerts_and_panels_name_metrics_and_labels_that_exist(where: str, expr: str) -> None:
    exposed = _exposed()
    metrics = _SELECTOR.findall(expr)
    assert metrics, f"{where}: no kvferry metric in {expr!r}"
    labels_used: set[str] = set()
    for name, selector in metrics:
        assert name in exposed, f"{where}: no process exposes {name}"
        for label, op, value in _MATCHER.findall(selector):
            assert label in exposed[name], f"{where}: {name} has no label {label!r}"
            known = KNOWN_VALUES.get((name, label))
            if known is not None:
                values = value.split("|") if op in ("=~", "!~") else [value]
                assert set(values) <= known, f"{where}: {name}{{{label}}} is never {set(values) - known}"
        labels_used |= set(exposed[name])
    for group in _GROUPING.findall(expr):  # by (...) names labels of the metrics summed
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in labels_used | {"instance", "job"}, f"{where}: no metric here has {label!r}"


def test_the_dashboard_is_grafana_json_with_a_prometheus_variable() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvferry.json").read_text())
    assert [v["type"] for v in dash["templating"]["list"]] == ["datasource"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


# -- the engines' roles ----------------------------------------------------------------------------

#: The NixlConnector kv_role each kind of node gets (vLLM 0.32 deprecates kv_both for it).
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
_KV_BOTH = re.compile(r'"kv_role"\s*:\s*"kv_both"')


def _kv_transfer_config(args: list[str]) -> dict[str, Any]:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config=")]
    config: dict[str, Any] = json.loads(value)
    return config


def _pods() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                yield path.name, doc["spec"]["template"]["spec"]


def test_each_vllm_pod_has_the_kv_role_of_its_sidecars_role() -> None:
    engines = 0
    for name, pod in _pods():
        vllm = [c for c in pod["containers"] if c["image"].startswith("vllm/")]
        if not vllm:
            continue
        (engine,) = vllm
        (sidecar,) = [c for c in pod["containers"] if "kvferry" in c["image"]]
        role = container_env(sidecar["env"])["KVFERRY_SIDECAR_ROLE"]
        config = _kv_transfer_config([str(a) for a in engine["args"]])
        assert config["kv_connector"] == "NixlConnector", name
        assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True, name
        assert config["kv_role"] == KV_ROLE[role], f"{name}: a {role} node with {config['kv_role']}"
        engines += 1
    assert engines == 2  # one prefill, one decode StatefulSet


def test_each_emulated_engine_has_the_role_of_its_sidecar() -> None:
    services = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    pairs = 0
    for name, service in services.items():
        if service["command"][0] != "sidecar":
            continue
        engine = services[service["network_mode"].removeprefix("service:")]
        (role,) = [a.split("=", 1)[1] for a in engine["command"] if a.startswith("--role=")]
        assert role == service["environment"]["KVFERRY_SIDECAR_ROLE"], name
        pairs += 1
    assert pairs == 2


def test_the_documented_vllm_command_has_the_current_kv_roles() -> None:
    readme = (DEPLOY / "README.md").read_text()
    (documented,) = re.findall(r"--kv-transfer-config '([^']*)'", readme)
    config = json.loads(documented)
    assert config["kv_role"] == KV_ROLE["prefill"] and '"kv_role": "kv_consumer"' in readme
    assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    for path in [*DEPLOY.rglob("*"), DEPLOY.parent / "README.md"]:
        if path.is_file() and path.suffix in (".md", ".yaml", ".yml", ".service", ".json", ""):
            assert not _KV_BOTH.search(path.read_text(errors="replace")), f"{path}: kv_role kv_both"

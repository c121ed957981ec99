"""deploy/'s files read as data: the Kubernetes documents, the pods they run and the kvferry
processes every deploy file starts (Kubernetes, compose, systemd), each with the flags and
variables it is given, so that the tests can hold them against this checkout's code."""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"

#: Each kind of kvferry process: the prefix of its variables.
PREFIXES = {"daemon": "KVFERRY_", "sidecar": "KVFERRY_SIDECAR_", "router": "KVFERRY_ROUTER_"}
#: The flags whose value is a file the process reads.
FILE_FLAGS = ("tls-ca", "tls-cert", "tls-key", "policy", "etcd-ca", "etcd-cert", "etcd-key")
#: The pod a manifest's $(POD_NAME) stands for in the tests: the first of its StatefulSet.
POD_IP = "10.1.2.3"


@dataclass
class Process:
    """One kvferry process as a deploy file starts it."""

    where: str
    argv: list[str]  # after `kvferry`
    env: dict[str, str] = field(default_factory=dict)
    pod: dict[str, Any] | None = None
    """Kubernetes: the pod spec it runs in."""
    container: dict[str, Any] | None = None
    """Kubernetes: its container."""
    workload: str = ""
    """Kubernetes: the Deployment's or StatefulSet's name."""

    @property
    def kind(self) -> str:
        """daemon, sidecar, router, emulate, certs."""
        return self.argv[0]

    def value(self, flag: str) -> str | None:
        """The value this process gets for `--flag`: from its command line, else from its
        variable (None: neither)."""
        for i, arg in enumerate(self.argv):
            if arg.startswith(f"--{flag}="):
                return arg.split("=", 1)[1]
            if arg == f"--{flag}" and i + 1 < len(self.argv):
                return self.argv[i + 1]
        prefix = PREFIXES.get(self.kind)
        return None if prefix is None else self.env.get(prefix + flag.upper().replace("-", "_"))


@functools.cache
def _documents() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple(
        (path.name, doc)
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    )


def documents() -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, document) of every Kubernetes manifest (read once: do not change them)."""
    yield from _documents()


def of_kind(kind: str) -> list[dict[str, Any]]:
    """Every manifest document of one kind."""
    return [doc for _, doc in documents() if doc["kind"] == kind]


def data_of(name: str) -> dict[str, str]:
    """The files of the ConfigMap or Secret `name`."""
    (doc,) = [d for d in of_kind("ConfigMap") + of_kind("Secret") if d["metadata"]["name"] == name]
    data: dict[str, str] = doc.get("data") or doc.get("stringData") or {}
    return data


def workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, Deployment or StatefulSet)."""
    for name, doc in documents():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield name, doc


def pod_name(workload: dict[str, Any]) -> str:
    """What $(POD_NAME) is in the tests: a StatefulSet's first pod."""
    return f"{workload['metadata']['name']}-0"


def substituted(value: str, pod: str = "pod-0") -> str:
    """Kubernetes' $(VAR) references, as a pod would see them."""
    return re.sub(r"\$\((\w+)\)", lambda m: {"POD_IP": POD_IP}.get(m[1], pod), value)


def container_env(env: list[dict[str, Any]], pod: str = "pod-0") -> dict[str, str]:
    """A container's variables (a secret's value is not in the manifest: any non-empty
    string stands for it)."""
    out = {}
    for var in env:
        out[var["name"]] = substituted(str(var["value"]), pod) if "value" in var else "from-a-secret"
    return out


def kubernetes() -> Iterator[Process]:
    """The kvferry processes of the Kubernetes manifests (not a container that runs another
    command, such as the admin pod's shell)."""
    for name, doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if "kvferry" in c["image"] and "command" not in c:
                env = container_env(c.get("env", []), pod_name(doc))
                args = [str(a) for a in c.get("args", [])]
                yield Process(f"{name}:{c['name']}", args, env, pod, c, doc["metadata"]["name"])


def compose_services() -> dict[str, Any]:
    """The compose file's services."""
    services: dict[str, Any] = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    return services


def compose() -> Iterator[Process]:
    """The compose file's processes."""
    for name, service in compose_services().items():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        yield Process(f"compose.yaml:{name}", [str(a) for a in service["command"]], env)


def systemd(instance: str = "decode0") -> Iterator[Process]:
    """The systemd units' processes (a template's %i: `instance`)."""
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        env: dict[str, str] = {}
        argv: list[str] = []
        for line in path.read_text().replace("%i", instance).splitlines():
            key, _, value = line.partition("=")
            if key == "Environment":
                name, _, var = value.partition("=")
                env[name] = var
            elif key == "ExecStart":
                command = shlex.split(value)
                assert command[0].endswith("/kvferry"), line
                argv = command[1:]
        yield Process(path.name, argv, env)


PROCESSES = [*kubernetes(), *compose(), *systemd()]


def labels_of(workload: dict[str, Any]) -> dict[str, str]:
    """A workload's pods' labels."""
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def volume_of(process: Process, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volumeMount, volume) that holds `path` in a Kubernetes process's container."""
    assert process.container is not None and process.pod is not None
    parent = str(Path(path).parent)
    mounts = [m for m in process.container.get("volumeMounts", []) if m["mountPath"] == parent]
    assert len(mounts) == 1, f"{process.where}: {path} is on no mount of its container"
    (volume,) = [v for v in process.pod.get("volumes", []) if v["name"] == mounts[0]["name"]]
    return mounts[0], volume

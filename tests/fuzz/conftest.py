"""Fixtures of the fuzz tests: the processes under test, each in a process of its own
(tests/fuzz/processes.py), started once for the session and stopped at its end.

Every fuzz test ends by checking that the process it fuzzed still serves a normal
request; a process that died makes every later test here fail at once, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz.processes import Deployment, Proc, daemon_proc, daemon_serves, start_deployment


@pytest.fixture(scope="session")
def deployment(etcd_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A daemon, an emulated engine, its sidecar and a router, for the session."""
    d = start_deployment(etcd_endpoint, tmp_path_factory.mktemp("fuzz-deployment"))
    yield d
    d.stop()


@pytest.fixture
def live(deployment: Deployment) -> Deployment:
    """The deployment, every process of it still running."""
    for p in deployment.procs:
        assert p.alive(), f"{p.name} died:\n{p.log_tail()}"
    return deployment


@pytest.fixture(scope="session")
def fuzz_daemon(etcd_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str]]:
    """A daemon of the gRPC fuzz's own (its random nodes must not reach the router):
    -> (its process, its address)."""
    proc, address = daemon_proc(etcd_endpoint, tmp_path_factory.mktemp("fuzz-daemon"), "fuzz-daemon")
    try:
        proc.wait(daemon_serves(address))
        yield proc, address
    finally:
        proc.stop()

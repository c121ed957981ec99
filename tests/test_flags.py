"""Flags read their KVFERRY_* variables; a variable no flag reads is reported."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import structlog

from kvferry import flags
from router import cli as router_cli
from router import settings as router_settings


def _args(**dests: Any) -> argparse.Namespace:
    return argparse.Namespace(**dests)


def test_unknown_variables_are_named_with_the_closest_flag() -> None:
    args = _args(side_channel_host="", engine_url="", log_level=None)
    env = {
        "KVFERRY_SIDECAR_SIDE_CHANEL_HOST": "10.0.0.1",  # misspelt
        "KVFERRY_SIDECAR_ENGINE_URL": "http://127.0.0.1:8000",  # a flag's
        "KVFERRY_SIDECAR_COLOUR": "blue",  # nothing like any flag
        "KVFERRY_LOG_LEVEL": "info",  # every process's
        "KVFERRY_ROUTER_LISTEN": "0.0.0.0:8000",  # the router's business
        "KVFERRY_SIDECAR_LOG_LEVEL": "debug",  # no such variable: it is KVFERRY_LOG_LEVEL
        "KVFERRY_SIDECAR_SERVICE_HOST": "10.0.0.9",  # Kubernetes' service links
        "KVFERRY_SIDECAR_PORT_8100_TCP_ADDR": "10.0.0.9",
        "PATH": "/bin",
    }
    assert flags.unknown_variables("KVFERRY_SIDECAR_", args, env) == [
        ("KVFERRY_SIDECAR_COLOUR", ""),
        ("KVFERRY_SIDECAR_LOG_LEVEL", ""),
        ("KVFERRY_SIDECAR_SIDE_CHANEL_HOST", "KVFERRY_SIDECAR_SIDE_CHANNEL_HOST"),
    ]
    # The daemon's prefix is the others' too: their variables are not its own.
    daemon_args = _args(listen="", etcd="")
    env = {"KVFERRY_LISTN": "x", "KVFERRY_ETCD": "e:2379", **env}
    assert flags.unknown_variables("KVFERRY_", daemon_args, env) == [("KVFERRY_LISTN", "KVFERRY_LISTEN")]


def test_a_process_logs_each_unknown_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_ROUTER_DEAMON", "d:50051")
    args = router_cli.build_parser().parse_args([])
    with structlog.testing.capture_logs() as logs:
        flags.warn_unknown_variables("router", router_settings.ENV_PREFIX, args)
    assert logs == [
        {
            "event": "config.unknown_variable",
            "log_level": "warning",
            "process": "router",
            "variable": "KVFERRY_ROUTER_DEAMON",
            "hint": "did you mean KVFERRY_ROUTER_DAEMON?",
        }
    ]

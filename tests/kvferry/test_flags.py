"""Flags read their KVFERRY_* variables; a variable no flag reads is reported."""

from __future__ import annotations

import argparse
import os
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


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from controlplane import settings as daemon_settings
    from emulator import cli as emulator_cli
    from sidecar import cli as sidecar_cli

    daemon = argparse.ArgumentParser()
    daemon_settings.add_arguments(daemon)
    return {
        "daemon": daemon,
        "sidecar": sidecar_cli.build_parser(),
        "router": router_cli.build_parser(),
        "emulator": emulator_cli.build_parser(),
    }


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_no_number_flag_takes_a_value_that_is_not_finite(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN fails every range check (each comparison is false): a safety margin, a deadline
    or a refresh interval of NaN was taken, and broke things later (a PULL 0.5 s before
    D's expiry, a lookup deadline uvloop refuses, a refresh loop that died)."""
    checked = 0
    for name, parser in _parsers().items():
        for action in parser._actions:
            if action.type is not float and getattr(action.type, "__name__", "") != "finite_float":
                continue
            checked += 1
            with pytest.raises(SystemExit):
                parser.parse_args([f"{action.option_strings[0]}={value}"])
            assert "must be a finite number" in capsys.readouterr().err, (name, action.dest)
    assert checked >= 19  # (every float flag of the four processes, when this was written)


@pytest.mark.parametrize("process", ["daemon", "sidecar", "router"])
def test_each_flag_reads_back_its_fields_default(process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag's default is its field's, as text (kvferry.flags.Flag.to_text); parsed back
    (Flag.to_field) it is that field's default again: no flag, no variable, no change."""
    from controlplane import settings as daemon_settings
    from sidecar import settings as sidecar_settings

    for name in [n for n in os.environ if n.startswith("KVFERRY_")]:
        monkeypatch.delenv(name)
    module = {"daemon": daemon_settings, "sidecar": sidecar_settings, "router": router_settings}[process]
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    defaults = module.Settings()
    assert flags.settings_from(parser.parse_args([]), module.FLAGS, defaults) == defaults


def test_a_flag_names_a_field_of_its_settings() -> None:
    """A mistyped field fails when the parser is built, not when the flag is used."""
    wrong = flags.Flag("listen", "server.lisen", "host:port")
    with pytest.raises(AttributeError):
        flags.add_flags(argparse.ArgumentParser(), "KVFERRY_ROUTER_", [wrong], router_settings.Settings())
    with pytest.raises(ValueError, match=r"group\.field"):
        flags.add_flags(
            argparse.ArgumentParser(),
            "KVFERRY_ROUTER_",
            [flags.Flag("listen", "listen", "")],
            router_settings.Settings(),
        )

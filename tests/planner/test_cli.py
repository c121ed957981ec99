"""`kvferry plan`: the table, the recommendation, the HTML report, and refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry import logs
from kvferry_cli.command import main


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvferry` configures the process's logging: not the test process's."""
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)


def _mooncake(tmp_path: Path) -> Path:
    lines = []
    for c in range(6):  # six conversations of four turns, a turn every 30 s
        for t in range(4):
            ids = [c * 100 + i for i in range(2 + 2 * t)]
            stamp = (c * 5 + 30 * t) * 1000
            lines.append(
                {"timestamp": stamp, "input_length": 512 * len(ids), "output_length": 64, "hash_ids": ids}
            )
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return path


def test_plan_prints_a_row_per_configuration_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "plan.html"
    code = main(
        ["plan", str(_mooncake(tmp_path)), "--format", "mooncake", "--ttl", "480,60", "--budget", "1,0.5",
         "--policy", "fixed,value", "--pool-blocks", "20000", "--report", str(report)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if "fixed |" in line or "value |" in line]
    assert len(rows) == 8
    assert "recommended: ttl 60s" in out  # (every return comes within 30 s: 480 s buys nothing)
    assert "24 turns in 6 conversations (timed)" in out
    page = report.read_text()
    assert page.count('src="data:image/png;base64,') == 3
    assert "Recommended:" in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--format", "mooncake", "--budget", "1.5"],
            "budget must be a share of the pool in (0, 1], not 1.5",
        ),
        (["--format", "kvferry"], "trace.jsonl:1: 't' must be a number (seconds)"),
        (["--format", "mooncake", "--clients", "0"], "--clients >= 1"),
    ],
)
def test_plan_refuses_bad_input_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = main(["plan", str(_mooncake(tmp_path)), *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_plan_refuses_an_unknown_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(_mooncake(tmp_path)), "--policy", "lru"])
    assert exited.value.code == 2
    assert "unknown policy 'lru'" in capsys.readouterr().err

"""The router's turn trace (`router.trace`): no content, salted digests, turn indexes, usage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry import logs
from router.cli import build_parser, main
from router.settings import from_args
from router.trace import TurnTrace, UsageSniffer


def test_usage_is_found_even_split_across_chunks() -> None:
    sniffer = UsageSniffer()
    for chunk in (b'data: {"usage": {"prompt_tok', b'ens": 1200, "completion_', b'tokens": 48}}\n\n'):
        sniffer.feed(chunk)
    assert (sniffer.prompt_tokens, sniffer.completion_tokens) == (1200, 48)


def test_the_trace_names_conversations_by_salted_digest_and_counts_their_turns(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    trace = TurnTrace(str(path))
    for conversation in ("secret-conv", "secret-conv", "other", ""):
        trace.record(
            started=1.5,
            tenant="tenant-a",
            conversation=conversation,
            prompt_tokens=10,
            output_tokens=2,
            reused_tokens=0,
            decision="RECOMPUTE",
            ttft_s=0.01,
            latency_s=0.02,
            reason="below_threshold",
        )
    trace.close()
    trace.close()  # (idempotent)
    text = path.read_text()
    assert "secret-conv" not in text and "tenant-a" not in text
    header, *lines = [json.loads(line) for line in text.splitlines()]
    assert header == {"kvferry_trace": 1, "salt_per_file": True}
    assert [x["turn"] for x in lines] == [0, 1, 0, 0]
    assert lines[0]["conversation"] == lines[1]["conversation"] != lines[2]["conversation"]
    assert lines[3]["conversation"] == ""
    assert lines[0]["ttft_ms"] == 10.0 and lines[0]["latency_ms"] == 20.0
    assert lines[0]["decision"] == "RECOMPUTE" and lines[0]["reason"] == "below_threshold"
    one, two = TurnTrace(str(tmp_path / "u.jsonl")), TurnTrace(str(tmp_path / "v.jsonl"))
    assert one.digest("secret-conv") != two.digest("secret-conv")
    one.close()
    two.close()


def test_the_router_refuses_a_trace_file_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # keep the process's logging as it is
    missing = tmp_path / "no-such-dir" / "t.jsonl"
    assert main(["--daemon", "127.0.0.1:1", "--trace-out", str(missing)]) == 2
    assert f"--trace-out {missing}: cannot write: No such file or directory" in capsys.readouterr().err


def test_the_trace_out_flag_and_its_variable_become_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert from_args(build_parser().parse_args(["--daemon", "d:1"])).server.trace_out == ""
    monkeypatch.setenv("KVFERRY_ROUTER_TRACE_OUT", "/var/log/kvferry/turns.jsonl")
    s = from_args(build_parser().parse_args(["--daemon", "d:1"]))
    assert s.server.trace_out == "/var/log/kvferry/turns.jsonl"

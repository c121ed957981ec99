"""The history check's figures in the session's terminal summary (``make test`` shows
them without -s)."""

from __future__ import annotations

import pytest

from tests.history.harness import SUMMARIES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARIES:
        terminalreporter.section("single-use history check")
        for line in SUMMARIES:
            terminalreporter.write_line(line)

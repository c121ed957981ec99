"""structlog, configured once per entrypoint: console on a terminal, JSON otherwise."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error")


def add_level_flag(p: argparse.ArgumentParser, **kw: Any) -> None:
    """`--log-level` (a parser of a subcommand passes ``default=argparse.SUPPRESS``, so that
    the flag given before the subcommand stands)."""
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LEVELS,
        help="default: $KVFERRY_LOG_LEVEL or info",
        **{"default": None, **kw},
    )


def configure(level: str | None = None, json: bool | None = None) -> None:
    level_name = (level or os.environ.get("KVFERRY_LOG_LEVEL", "info")).lower()
    unknown = level_name not in LEVELS
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if unknown else getattr(logging, level_name.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    if unknown:  # (only $KVFERRY_LOG_LEVEL can be: the flags take only LEVELS)
        structlog.get_logger(__name__).warning(
            "log.level.unknown", level=level_name, using="info", levels=", ".join(LEVELS)
        )


class Outage:
    """Says when a retried operation's failures are worth a log line: the first failure
    of an outage, then one a minute, and its end (a loop that retries twice a second
    would otherwise write 7,200 identical warnings an hour)."""

    def __init__(self, every_s: float = 60.0) -> None:
        self._every_s = every_s
        self.since = 0.0
        """When the current outage began (time.monotonic()); 0 = none."""
        self._warned = 0.0

    def failed(self, now: float) -> bool:
        """A failure at `now`: True when it should be logged."""
        due = not self.since or now - self._warned >= self._every_s
        self.since = self.since or now
        if due:
            self._warned = now
        return due

    def ok(self, now: float) -> float | None:
        """A success at `now`: the seconds the outage lasted when one just ended, else None."""
        if not self.since:
            return None
        lasted, self.since = now - self.since, 0.0
        return lasted

    def report(
        self, logger: Any, succeeded: bool, failed_event: str, recovered_event: str, **fields: Any
    ) -> None:
        """One attempt's outcome, logged when it is news: `failed_event` (a warning, with
        `fields` and how long it has been failing) or `recovered_event` (how long it failed)."""
        now = time.monotonic()
        if succeeded:
            if (lasted := self.ok(now)) is not None:
                logger.info(recovered_event, failed_s=round(lasted, 1))
        elif self.failed(now):
            logger.warning(failed_event, failing_s=round(now - self.since, 1), **fields)


class Throttle:
    """Says when one more of a repeated warning is worth a log line: the first, then at
    most one per `every_s`, telling how many were left out meanwhile (a flood of bad
    frames would otherwise write one line each, thousands a second). Count every one
    elsewhere (a metric): this only thins the log."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every_s = every_s
        self._logged_at: float | None = None
        self._left_out = 0

    def due(self, now: float) -> int | None:
        """One more at `now` -> None when it is not to be logged, else how many were left
        out since the last line."""
        if self._logged_at is not None and now - self._logged_at < self._every_s:
            self._left_out += 1
            return None
        left_out, self._left_out, self._logged_at = self._left_out, 0, now
        return left_out

"""Server-sent events framing for the relays that look inside D's stream (the router's
scrubber, the sidecar's tap). Pure.

vLLM streams ``data: {...}`` events, each ended by a blank line. A relay that
must look inside events gets them whole from `SseEvents`: complete events go out
as soon as their terminating blank line has arrived, and only an unterminated
event's tail is held back.

Lines end in CRLF, LF or CR, as the SSE specification allows, mixed at will
(vLLM ends them with LF, sse-starlette with CRLF). An event ends at the first
empty line; a run of empty lines ends one event. `split_events` cuts complete
bytes into `SseEvent`s that keep their own line ends, so that `join_events`
gives the same bytes back. A chunk that ends in a CR may be followed by the LF
of a CRLF: the event goes out at once all the same, and that LF, when it comes,
is read as an empty line of its own (an event with no lines, which SSE ignores
and the relays pass on as it is).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, TypeGuard

#: What a chunk that ends exactly at an event's end ends with: a line end, then an
#: empty line's (a line end is CRLF, LF or CR; these are every such pair's last bytes).
_EVENT_ENDS = (b"\n\n", b"\n\r\n", b"\r\r\n", b"\n\r", b"\r\r")
#: Two line ends in a row, by their first two bytes: every event's end holds one of
#: them, and each of them ends an event (a CR followed by an LF is one CRLF).
_PAIRS = (b"\n\n", b"\r\r", b"\n\r")
#: An event's end: its last line's line end and one or more empty lines. (Atomic groups:
#: a CRLF is never taken for a CR and an LF.)
_EVENT_END = re.compile(rb"((?>\r\n|\r|\n)(?>\r\n|\r|\n)++)")
_LINE_END_BYTES = b"\r\n"


def is_error_event(obj: Any) -> TypeGuard[dict[str, Any]]:
    """Whether a decoded event is vLLM's error event, which ends a stream whose request
    failed after it began (``{"error": {...}}``, no choices)."""
    return isinstance(obj, dict) and "error" in obj and "choices" not in obj


class SseEvent(NamedTuple):
    """One event as it came."""

    lines: bytes
    """Its lines, joined by their own line ends, without the last line's ("" for empty
    lines before an event, which SSE ignores)."""
    end: bytes
    """The line ends that close it: its last line's and the empty lines' after it (for an
    unterminated event at the end of a stream, whatever line end it has)."""


def split_events(data: bytes) -> list[SseEvent]:
    """The events of `data`, in order; what follows the last event's end (an unterminated
    event) is the last one. `join_events` of them is `data`."""
    if b"\r" in data or b"\n\n\n" in data:
        parts = _EVENT_END.split(data)
        events = [SseEvent(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        rest = parts[-1]
    else:  # LF line ends, no run of empty lines (as vLLM writes): ten times as fast
        *whole, rest = data.split(b"\n\n")
        events = [SseEvent(lines, b"\n\n") for lines in whole]
    if rest:
        lines = rest.rstrip(_LINE_END_BYTES)
        events.append(SseEvent(lines, rest[len(lines) :]))
    if events and events[0].lines[:1] in (b"\r", b"\n"):  # (only the first can start empty)
        first = events[0]
        lines = first.lines.lstrip(_LINE_END_BYTES)
        lead = first.lines[: len(first.lines) - len(lines)]
        events[0:1] = [SseEvent(b"", lead), SseEvent(lines, first.end)]
    return events


def join_events(events: list[SseEvent]) -> bytes:
    """`events` framed again, each with its own line ends."""
    return b"".join([part for event in events for part in event])


def _end_of_last_event(data: bytes, start: int) -> int:
    """Where the last event that ends in `data` ends (0: none does), looking for event ends
    from `start` on."""
    at = max(data.rfind(pair, start) for pair in _PAIRS)
    if at < 0:
        return 0
    # The pair's second byte starts the empty line's line end: a CRLF takes one byte more.
    # (The rightmost pair leaves no line end after this one: it would make another pair.)
    return at + (3 if data[at + 1 : at + 3] == b"\r\n" else 2)


class SseEvents:
    """Cuts a byte stream into complete SSE events."""

    def __init__(self) -> None:
        self._buffer = b""
        """The unterminated event held back: it has no event end (no two line ends in a row)."""

    def complete(self, chunk: bytes) -> bytes:
        """The complete events that `chunk` finishes, line ends included (b"" when none);
        what follows the last event's end is held back for the next chunk."""
        held = self._buffer
        data = held + chunk if held else chunk
        if data.endswith(_EVENT_ENDS):
            self._buffer = b""
            return data  # the common case: whole events (no copy when nothing was held)
        # (the part held back has no event end: one starts at its last byte at the earliest)
        cut = _end_of_last_event(data, max(len(held) - 1, 0))
        complete, self._buffer = data[:cut], data[cut:]
        return complete

    def flush(self) -> bytes:
        """What is held back (an unterminated event) at the end of the stream."""
        rest, self._buffer = self._buffer, b""
        return rest

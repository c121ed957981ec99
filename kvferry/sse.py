"""Server-sent events framing for the relays that rewrite D's stream (router, sidecar). Pure.

vLLM streams ``data: {...}`` events, each ended by a blank line. A relay that
must look inside events gets them whole from `SseEvents`: complete events go out
as soon as their terminating blank line has arrived, and only an unterminated
event's tail is held back. A server that ends lines with CRLF is recognised by its
first line end and framed with CRLF from then on.
"""

from __future__ import annotations

from typing import Any, TypeGuard

_LF = b"\n\n"
_CRLF = b"\r\n\r\n"


def is_error_event(obj: Any) -> TypeGuard[dict[str, Any]]:
    """Whether a decoded event is vLLM's error event, which ends a stream whose request
    failed after it began (``{"error": {...}}``, no choices)."""
    return isinstance(obj, dict) and "error" in obj and "choices" not in obj


class SseEvents:
    """Cuts a byte stream into complete SSE events."""

    def __init__(self) -> None:
        self._buffer = b""
        self._sep: bytes | None = None  # decided at the stream's first line end

    def complete(self, chunk: bytes) -> bytes:
        """The complete events that `chunk` finishes, separators included (b"" when none);
        what follows the last separator is held back for the next chunk."""
        data = self._buffer + chunk if self._buffer else chunk
        sep = self._sep
        if sep is None:
            first = data.find(b"\n")
            if first < 0:  # no line has ended yet, so no event either
                self._buffer = data
                return b""
            sep = self._sep = _CRLF if first and data[first - 1] == 0x0D else _LF
        if not self._buffer and data.endswith(sep):
            return data  # the common case: whole events, no copy
        end = data.rfind(sep)
        if end < 0:
            self._buffer = data
            return b""
        cut = end + len(sep)
        complete, self._buffer = data[:cut], data[cut:]
        return complete

    def split(self, complete: bytes) -> list[bytes]:
        """The events of `complete` (as `complete` returned it), without their separators."""
        sep = self._sep or _LF
        return complete[: -len(sep)].split(sep)

    def join(self, events: list[bytes]) -> bytes:
        """`events` framed again, each with its separator."""
        sep = self._sep or _LF
        return sep.join(events) + sep

    def flush(self) -> bytes:
        """What is held back (an unterminated event) at the end of the stream."""
        rest, self._buffer = self._buffer, b""
        return rest

"""D's answer as the client gets it: vLLM's format, without the router's plumbing. Pure.

D returns ``kv_transfer_params`` describing the blocks it keeps for the next
turn (in the final chunk of a stream, at the top level of a JSON answer). They
are the control plane's business, not the client's: a JSON answer gets
``"kv_transfer_params": null`` (what a plain vLLM server answers), a stream's
event loses the key. Everything else passes byte for byte.

Streams are relayed as they come: a chunk of complete SSE events without the
key goes out unchanged, with no parsing; only an unterminated event's tail is
held back until its end arrives.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvferry.decoding import UNDECODABLE
from kvferry.sse import SseEvent, SseEvents, is_error_event, join_events, split_events

_MARKER = b'"kv_transfer_params"'
#: How an error event's JSON starts; inside a JSON string its quotes would be escaped.
_ERROR = b'{"error"'
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def scrub_json(raw: bytes) -> bytes:
    """A JSON answer with its kv_transfer_params nulled (the same bytes when there are none)."""
    if _MARKER not in raw:
        return raw
    try:
        obj: Any = _decode(raw)
    except UNDECODABLE:
        return raw
    if not isinstance(obj, dict) or obj.get("kv_transfer_params") is None:
        return raw
    obj["kv_transfer_params"] = None
    return _encode(obj)


class SseScrubber:
    """Removes kv_transfer_params from the SSE events of a stream that carry them."""

    def __init__(self) -> None:
        self._events = SseEvents()
        self.error: int | None = None
        """The status code of the first error event relayed (vLLM ends a stream whose
        request failed after it began, a failed KV load say, with ``data: {"error": ...}``)."""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send the client now for `chunk`."""
        complete = self._events.complete(chunk)
        if _ERROR in complete and self.error is None:
            self.error = _error_code(split_events(complete))
        if _MARKER not in complete:
            return complete  # the common case: passes with no parsing
        return join_events([SseEvent(_scrub_event(e.lines), e.end) for e in split_events(complete)])

    def flush(self) -> bytes:
        """What is held back at the end of the stream (an unterminated event)."""
        return self._events.flush()


def _data_object(event: bytes, marker: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``data:`` event holding `marker` (None: not such an event)."""
    if marker not in event or not event.startswith(b"data:"):
        return None
    try:
        obj: Any = _decode(event[5:].strip())
    except UNDECODABLE:
        return None
    return obj if isinstance(obj, dict) else None


def _error_code(events: list[SseEvent]) -> int | None:
    for event in events:
        obj = _data_object(event.lines, _ERROR)
        if is_error_event(obj):
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            return code if isinstance(code, int) and not isinstance(code, bool) else 500
    return None


def _scrub_event(event: bytes) -> bytes:
    obj = _data_object(event, _MARKER)
    if obj is None or "kv_transfer_params" not in obj:
        return event
    del obj["kv_transfer_params"]
    return b"data: " + _encode(obj)

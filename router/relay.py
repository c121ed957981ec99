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

_MARKER = b'"kv_transfer_params"'
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def scrub_json(raw: bytes) -> bytes:
    """A JSON answer with its kv_transfer_params nulled (the same bytes when there are none)."""
    if _MARKER not in raw:
        return raw
    try:
        obj: Any = _decode(raw)
    except msgspec.DecodeError:
        return raw
    if not isinstance(obj, dict) or obj.get("kv_transfer_params") is None:
        return raw
    obj["kv_transfer_params"] = None
    return _encode(obj)


class SseScrubber:
    """Cuts a byte stream into SSE events and removes kv_transfer_params from the ones carrying them."""

    def __init__(self) -> None:
        self._buffer = b""
        self._sep = b"\n\n"

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send the client now for `chunk`."""
        data = self._buffer + chunk if self._buffer else chunk
        if not self._buffer and data.endswith(self._sep) and _MARKER not in data:
            return data  # the common case: whole events, nothing to remove
        if b"\r\n\r\n" in data[:512]:
            self._sep = b"\r\n\r\n"
        sep = self._sep
        end = data.rfind(sep)
        if end < 0:
            self._buffer = data
            return b""
        cut = end + len(sep)
        complete, self._buffer = data[:cut], data[cut:]
        if _MARKER not in complete:
            return complete
        events = complete[: -len(sep)].split(sep)
        return sep.join([_scrub_event(e) for e in events]) + sep

    def flush(self) -> bytes:
        """What is held back at the end of the stream (an unterminated event)."""
        rest, self._buffer = self._buffer, b""
        return rest


def _scrub_event(event: bytes) -> bytes:
    if _MARKER not in event or not event.startswith(b"data:"):
        return event
    try:
        obj: Any = _decode(event[5:].strip())
    except msgspec.DecodeError:
        return event
    if not isinstance(obj, dict) or "kv_transfer_params" not in obj:
        return event
    del obj["kv_transfer_params"]
    return b"data: " + _encode(obj)

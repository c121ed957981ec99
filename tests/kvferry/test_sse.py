"""SSE framing shared by the router's scrubber and the sidecar's tap: however the bytes
are cut, every complete event comes out whole and in order, and nothing is lost."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvferry.sse import SseEvents

EVENTS = [b'data: {"a": 1}', b'data: {"choices": []}', b"data: [DONE]"]


def relay(stream: bytes, cuts: list[int]) -> tuple[list[bytes], bytes]:
    sse, events, out = SseEvents(), [], b""
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    for lo, hi in itertools.pairwise(bounds):
        complete = sse.complete(stream[lo:hi])
        out += complete
        if complete:
            events += sse.split(complete)
    return events, out + sse.flush()


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12), st.booleans())
def test_any_chunking_gives_the_same_events_and_bytes(cuts: list[int], crlf: bool) -> None:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    stream = sep.join(EVENTS) + sep + b'data: {"unterminated'
    events, out = relay(stream, cuts)
    assert events == EVENTS
    assert out == stream  # the unterminated tail comes out at flush


def test_join_frames_with_the_streams_own_separator() -> None:
    sse = SseEvents()
    complete = sse.complete(b"data: 1\r\n\r\ndata: 2\r\n\r\n")
    assert sse.join(sse.split(complete)) == complete


def test_a_long_first_event_of_a_crlf_stream_is_not_held_back() -> None:
    sse = SseEvents()
    first = b"data: " + b"x" * 2000 + b"\r\n\r\n"
    assert sse.complete(first[:700]) == b""
    assert sse.complete(first[700:] + b"data: 2\r\n\r\n") == first + b"data: 2\r\n\r\n"

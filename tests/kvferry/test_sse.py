"""SSE framing shared by the router's scrubber and the sidecar's tap: however the bytes
are cut and whatever line ends the server writes, every complete event comes out whole
and in order, and nothing is lost."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvferry.sse import SseEvent, SseEvents, join_events, split_events
from router.relay import SseScrubber
from sidecar.capture import SseRewriter, TurnObserver

EVENTS = [b'data: {"a": 1}', b'data: {"choices": []}', b"data: [DONE]"]
LINE_ENDS = (b"\n", b"\r\n", b"\r")


def _chunks(stream: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    return [stream[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def relay(stream: bytes, cuts: list[int]) -> tuple[list[bytes], bytes]:
    """(the events' lines, in order, empty lines left out; the bytes relayed)"""
    sse, events, out = SseEvents(), [], b""
    for chunk in _chunks(stream, cuts):
        complete = sse.complete(chunk)
        out += complete
        if complete:
            events += [e.lines for e in split_events(complete) if e.lines]
    return events, out + sse.flush()


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12), st.booleans())
def test_any_chunking_gives_the_same_events_and_bytes(cuts: list[int], crlf: bool) -> None:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    stream = sep.join(EVENTS) + sep + b'data: {"unterminated'
    events, out = relay(stream, cuts)
    assert events == EVENTS
    assert out == stream  # the unterminated tail comes out at flush


@st.composite
def _mixed_stream(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A stream whose every line end is drawn (LF, CRLF or CR), some events with empty
    lines before them; -> (the stream, its events' lines)."""
    out, events = b"", []

    def line_end() -> bytes:
        # (after a CR, an LF would not be a line end of its own but complete a CRLF)
        end: bytes = draw(st.sampled_from(LINE_ENDS[1:] if out.endswith(b"\r") else LINE_ENDS))
        return end

    for i in range(draw(st.integers(min_value=1, max_value=6))):
        if draw(st.booleans()):
            out += line_end()  # an empty line before the event, which SSE ignores
        lines = [b"event: e%d" % i] if draw(st.booleans()) else []
        lines.append(b'data: {"i": %d}' % i)
        start = len(out)
        for line in lines:
            out += line
            end = line_end()
            out += end
        events.append(out[start : len(out) - len(end)])
        for _ in range(draw(st.integers(min_value=1, max_value=3))):
            out += line_end()
    return out, events


@given(_mixed_stream(), st.lists(st.integers(min_value=0, max_value=400), max_size=16))
def test_line_ends_may_be_lf_crlf_or_cr_mixed(stream: tuple[bytes, list[bytes]], cuts: list[int]) -> None:
    data, expected = stream
    events, out = relay(data, cuts)
    assert events == expected
    assert out == data


def test_join_frames_each_event_with_its_own_line_ends() -> None:
    sse = SseEvents()
    complete = sse.complete(b"data: 1\r\n\r\ndata: 2\n\ndata: 3\r\r")
    assert split_events(complete) == [
        SseEvent(b"data: 1", b"\r\n\r\n"),
        SseEvent(b"data: 2", b"\n\n"),
        SseEvent(b"data: 3", b"\r\r"),
    ]
    assert join_events(split_events(complete)) == complete


def test_a_crlf_is_one_line_end_not_an_empty_line() -> None:
    sse = SseEvents()
    assert sse.complete(b"data: 1\r\n") == b""
    assert sse.complete(b"data: more\r\n\r\n") == b"data: 1\r\ndata: more\r\n\r\n"


def test_a_crlf_cut_after_its_cr_leaves_an_empty_line() -> None:
    """An event ended by CR goes out at once; the LF that turns out to complete its CRLF
    is an empty line (no event) before the next one."""
    sse = SseEvents()
    assert sse.complete(b"data: 1\r\n\r") == b"data: 1\r\n\r"
    complete = sse.complete(b"\ndata: 2\r\n\r\n")
    assert split_events(complete) == [SseEvent(b"", b"\n"), SseEvent(b"data: 2", b"\r\n\r\n")]


def test_a_long_first_event_of_a_crlf_stream_is_not_held_back() -> None:
    sse = SseEvents()
    first = b"data: " + b"x" * 2000 + b"\r\n\r\n"
    assert sse.complete(first[:700]) == b""
    assert sse.complete(first[700:] + b"data: 2\r\n\r\n") == first + b"data: 2\r\n\r\n"


# -- the router and the sidecar see the same events -------------------------------------------


@dataclass
class _Recording(TurnObserver):
    """A sidecar's observer that notes the ``i`` of every event it reads."""

    seen: list[int] = field(default_factory=list)

    def observe(self, obj: Any) -> bool:
        if isinstance(obj, dict) and "i" in obj:
            self.seen.append(obj["i"])
        return super().observe(obj)


def _params_stream(ends: list[bytes]) -> bytes:
    """Events ``{"i": n, "kv_transfer_params": ...}``, event n ended by ends[n] twice."""
    return b"".join(
        b'data: {"i":%d,"kv_transfer_params":{"x":1}}' % i + end * 2 for i, end in enumerate(ends)
    )


def _check_router_and_sidecar(ends: list[bytes], cuts: list[int]) -> None:
    stream = _params_stream(ends)
    scrubber, observer = SseScrubber(), _Recording(strip_token_ids=False)
    rewriter = SseRewriter(observer)
    scrubbed, tapped = b"", b""
    for chunk in _chunks(stream, cuts):
        scrubbed += scrubber.feed(chunk)
        tapped += rewriter.feed(chunk)
    scrubbed += scrubber.flush()
    tapped += rewriter.flush()
    # the router took every event's params out, each event keeping its line ends
    assert scrubbed == b"".join(b'data: {"i":%d}' % i + end * 2 for i, end in enumerate(ends))
    # the sidecar read every event once, in order, and passed the bytes as they came
    assert observer.seen == list(range(len(ends)))
    assert tapped == stream


@given(
    st.lists(st.sampled_from(LINE_ENDS), min_size=1, max_size=5),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_router_and_sidecar_split_a_stream_into_the_same_events(ends: list[bytes], cuts: list[int]) -> None:
    _check_router_and_sidecar(ends, cuts)


def test_router_and_sidecar_agree_when_a_crlf_is_cut_between_chunks() -> None:
    ends = [b"\r\n", b"\r\n"]
    cut = _params_stream(ends).index(b"\r\n\r\n") + 3  # (between the empty line's CR and LF)
    _check_router_and_sidecar(ends, [cut])

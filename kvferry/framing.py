"""How many of Leases/Stream's ops (or results) go in one gRPC message.

Both sides send whatever is ready in one message, and at long contexts an op is
large: a 64k-token registration is ~110 KB (block ids and digests), a PULL answer
~45 KB. Dozens ready at once would make one message over the receiver's limit
(the daemon takes 4 MiB by default), and gRPC then ends the whole stream, failing
every op on it; resent together, they would fail again. So a batch is cut into
messages of at most MESSAGE_BUDGET bytes.

The daemon encodes each result once, as it is made, and writes a message as those
encodings side by side (`encoded_runs`): a repeated message field's wire format is
just that, and it spares copying every result into a batch, sizing it, and encoding
the batch again (about a tenth of a busy daemon's CPU went there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

MESSAGE_BUDGET = 1024 * 1024
"""Encoded bytes of the ops in one message: a quarter of the daemon's default limit."""


class _Sized(Protocol):
    def ByteSize(self) -> int: ...


M = TypeVar("M", bound=_Sized)
T = TypeVar("T")


def by_size(items: Sequence[M], budget: int = MESSAGE_BUDGET) -> Iterator[list[M]]:
    """`items` in order, in runs whose encoded sizes add up to at most `budget` (an item
    larger than that goes alone: the receiver's own limit decides about it)."""
    return _runs(items, _byte_size, budget)


def encoded_runs(encoded: Sequence[bytes], field: int, budget: int = MESSAGE_BUDGET) -> Iterator[bytes]:
    """Messages whose repeated message field number `field` holds `encoded` (each one
    message, encoded), in order, cut as `by_size` cuts them: each the bytes of a message
    with only that field (e.g. a LeaseOpResultBatch of LeaseOpResults, field 1)."""
    key = _varint(field << 3 | 2)  # (wire type 2: length-delimited)
    for run in _runs(encoded, len, budget):
        yield b"".join(part for item in run for part in (key, _varint(len(item)), item))


def _runs(items: Sequence[T], size_of: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """`items` in order, in runs whose sizes (`size_of`) add up to at most `budget`, an
    item larger than that alone."""
    if len(items) == 1:
        yield list(items)
        return
    run: list[T] = []
    size = 0
    for item in items:
        n = size_of(item)
        if run and size + n > budget:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _byte_size(message: _Sized) -> int:
    return message.ByteSize()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)

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

from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

MESSAGE_BUDGET = 1024 * 1024
"""Encoded bytes of the ops in one message: a quarter of the daemon's default limit."""


class _Sized(Protocol):
    def ByteSize(self) -> int: ...


M = TypeVar("M", bound=_Sized)


def by_size(items: Sequence[M], budget: int = MESSAGE_BUDGET) -> Iterator[list[M]]:
    """`items` in order, in runs whose encoded sizes add up to at most `budget` (an item
    larger than that goes alone: the receiver's own limit decides about it)."""
    if len(items) == 1:
        yield list(items)
        return
    run: list[M] = []
    size = 0
    for item in items:
        n = item.ByteSize()
        if run and size + n > budget:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encoded_runs(encoded: Sequence[bytes], field: int, budget: int = MESSAGE_BUDGET) -> Iterator[bytes]:
    """Messages whose repeated message field number `field` holds `encoded` (each one
    message, encoded), in order, cut as `by_size` cuts them: each the bytes of a message
    with only that field (e.g. a LeaseOpResultBatch of LeaseOpResults, field 1)."""
    key = _varint(field << 3 | 2)  # (wire type 2: length-delimited)
    run: list[bytes] = []
    size = 0
    for item in encoded:
        if run and size + len(item) > budget:
            yield b"".join(run)
            run, size = [], 0
        run += (key, _varint(len(item)), item)
        size += len(item)
    if run:
        yield b"".join(run)

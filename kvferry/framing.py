"""How many of Leases/Stream's ops (or results) go in one gRPC message.

Both sides send whatever is ready in one message, and at long contexts an op is
large: a 64k-token registration is ~110 KB (block ids and digests), a PULL answer
~45 KB. Dozens ready at once would make one message over the receiver's limit
(the daemon takes 4 MiB by default), and gRPC then ends the whole stream, failing
every op on it; resent together, they would fail again. So a batch is cut into
messages of at most MESSAGE_BUDGET bytes.
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

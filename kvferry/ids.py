"""The rule for the ids every process hands the daemon (engine, conversation, tenant and
request ids): the daemon refuses what breaks it, so the others check it the same way."""

from __future__ import annotations

import re

MAX_ID_BYTES = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""A control character (C0 or DEL): one C-speed search, on every lookup's ids."""


def id_problem(name: str, value: str, max_bytes: int = MAX_ID_BYTES) -> str:
    """What is wrong with `value` as an id ("" = nothing): too long, or control characters."""
    try:
        size = len(value.encode())
    except UnicodeEncodeError:  # (a lone surrogate: what a non-UTF-8 argument decodes to)
        return f"{name} is not valid UTF-8"
    if size > max_bytes:
        return f"{name} is {size} bytes, at most {max_bytes} allowed"
    if _CONTROL.search(value):
        return f"{name} contains control characters"
    return ""

"""What decoding bytes from outside with msgspec can raise, and client values read as vLLM
reads them."""

from __future__ import annotations

from typing import Any

import msgspec

UNDECODABLE: tuple[type[Exception], ...] = (msgspec.DecodeError, RecursionError)
"""msgspec.DecodeError (ValidationError is one), and RecursionError: msgspec's answer to
input nested deeper than it recurses, which a client can send in 2 KB (``[[[[...``)."""

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any) -> bool:
    """`value` as pydantic reads a bool field in lax mode, as vLLM's request models do:
    a bool, 0 or 1 (also 0.0 and 1.0), or a string like "true" or "off" in any case.
    ValueError for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
    raise ValueError(f"not a boolean: {value!r}")

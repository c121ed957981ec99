"""What decoding bytes from outside with msgspec can raise."""

from __future__ import annotations

import msgspec

UNDECODABLE: tuple[type[Exception], ...] = (msgspec.DecodeError, RecursionError)
"""msgspec.DecodeError (ValidationError is one), and RecursionError: msgspec's answer to
input nested deeper than it recurses, which a client can send in 2 KB (``[[[[...``)."""

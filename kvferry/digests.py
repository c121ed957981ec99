"""Block digests of a token sequence: the one function the sidecar and the router share.

kvferry verifies that the prompt a prefill node is about to compute really begins
with the tokens whose KV a decode node holds (vLLM does not: issue 43094). Both
sides cut their token sequence into full blocks and digest each block chained on
the previous digest, so the longest common prefix of two digest lists is exactly
the number of leading blocks whose tokens (and everything before them) agree.

The chain is seeded by the model and the LoRA adapter, so blocks of different
models or adapters never match. The digest is 16 bytes of BLAKE2b: collision-safe
for this purpose and about 3x cheaper than vLLM's sha256 over CBOR.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

DIGEST_SIZE = 16
_MAX_TOKEN = 2**32 - 1
_ID_BYTES = 4
assert array.array("I").itemsize == _ID_BYTES, "uint32 token ids"


def seed(model: str, adapter: str = "") -> bytes:
    """The chain's starting value for one model and adapter identity."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvferry-seed")
    h.update(model.encode())
    h.update(b"\0")
    h.update(adapter.encode())
    return h.digest()


def block_digests(tokens: Sequence[int], block_size: int, chain_seed: bytes) -> bytes:
    """Digests of every full block of `tokens`, concatenated (DIGEST_SIZE bytes each).

    A trailing partial block gets no digest: its tokens cannot be verified and
    are never pulled on the strength of a digest. Each block is its token ids as
    little-endian uint32, hashed after the previous digest (the seed for the first).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(tokens) // block_size
    try:
        ids = array.array("I", tokens[: n_full * block_size])  # range- and type-checked in C
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN}]") from e
    if sys.byteorder != "little":
        ids.byteswap()
    data = ids.tobytes()
    step = block_size * _ID_BYTES
    blake2b = hashlib.blake2b
    parent = chain_seed
    out = []
    # One call per block (hash object, update and digest in one) on a 64k-token prompt:
    # 2.2 ms here against 3.0 for the three-call form; it is on every turn's critical path.
    for start in range(0, len(data), step):
        parent = blake2b(parent + data[start : start + step], digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return b"".join(out)


def common_prefix_blocks(a: bytes, b: bytes) -> int:
    """Number of leading digests two concatenated digest lists share."""
    n = min(len(a), len(b)) // DIGEST_SIZE
    if a[: n * DIGEST_SIZE] == b[: n * DIGEST_SIZE]:
        return n
    lo, hi = 0, n  # invariant: first lo blocks equal, block hi-1 .. differs somewhere below hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * DIGEST_SIZE] == b[: mid * DIGEST_SIZE]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def seed_for(base_model: str, requested_model: str) -> bytes:
    """The chain seed for one request: the node's base model, plus the adapter when
    the request names another model (a LoRA adapter). The sidecar and the router
    both use this, or their digests never match."""
    return seed(base_model, "" if requested_model in ("", base_model) else requested_model)

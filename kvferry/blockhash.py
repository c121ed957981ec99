"""vLLM's chained prefix-cache block hashes with ``sha256_cbor`` (shared: the emulator
produces them; the router computes them to ask which prefill node caches a prompt).

Per full block: ``sha256(cbor2.dumps((parent or NONE_HASH, tuple(tokens),
extra_keys or None), canonical=True))``, chained on the full 32-byte digest.
``NONE_HASH`` is the hash of ``PYTHONHASHSEED`` when set, else of
``"vllm-none-hash"``. KV events carry the digest's low 64 bits as an int.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import cbor2

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 over the canonical CBOR encoding of a value."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash_seed() -> str:
    """The seed NONE_HASH derives from: PYTHONHASHSEED when set, else the fixed default."""
    seed = os.environ.get("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of a sequence's first block."""
    return sha256_cbor(none_hash_seed() if seed is None else seed)


def hash_block_tokens(
    parent: bytes | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    root: bytes | None = None,
) -> bytes:
    """Hash of one full block, chained on its parent's digest."""
    seed = parent if parent is not None else (root if root is not None else none_hash())
    return sha256_cbor((seed, tuple(tokens), extra_keys or None))


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    root: bytes | None = None,
) -> list[bytes]:
    """Digests of every full block of a token sequence; a partial tail has none."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    root = none_hash() if root is None else root
    hashes: list[bytes] = []
    previous = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash_block_tokens(previous, tokens[start : start + block_size], root=root)
        hashes.append(previous)
    return hashes


def external_block_hash(digest: bytes) -> int:
    """The block hash as KV events carry it: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")

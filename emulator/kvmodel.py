"""The emulated model: what a KV slot holds and how tokens are generated.

Each token position has an 8-byte KV value, a digest of the token, its
position and the previous position's KV value, so (like real KV) a slot depends
on the whole history before it. A block is ``block_size`` such slots. Pulled
blocks carry the remote engine's slot values verbatim; nothing is recomputed.

Generation reads the whole context: the sampler state after prefill is a
digest over every KV slot of the sequence, and each decode step folds in the KV
of the token just fed back. The same KV gives the same answer; KV of other
tokens (a wrong pull) gives a different one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from emulator.tokenizer import EOS_TOKEN_ID

SLOT_BYTES = 8
#: KV "before" position 0.
GENESIS_KV = bytes(SLOT_BYTES)
#: Fewest tokens an answer has before it may stop on its own.
MIN_ANSWER_TOKENS = 4
#: A stop is sampled with probability 1/STOP_ONE_IN per step after that.
STOP_ONE_IN = 20


def token_kv(previous: bytes, position: int, token: int) -> bytes:
    """KV value of a token at a position, given the previous position's KV."""
    data = previous + position.to_bytes(8, "big") + token.to_bytes(4, "big")
    return hashlib.blake2b(data, digest_size=SLOT_BYTES).digest()


def chain_kv(previous: bytes, start: int, tokens: Sequence[int]) -> bytearray:
    """KV slots of ``tokens`` at positions ``start, start + 1, ...``, concatenated: ``token_kv``
    chained from ``previous``, the KV of position ``start - 1``, in one tight loop."""
    out = bytearray()
    blake2b = hashlib.blake2b
    position = start
    for token in tokens:
        data = previous + position.to_bytes(8, "big") + token.to_bytes(4, "big")
        previous = blake2b(data, digest_size=SLOT_BYTES).digest()
        out += previous
        position += 1
    return out


def context_state(slots: Iterable[bytes | bytearray | memoryview]) -> bytes:
    """Sampler state after prefill: a digest over all KV slots in order."""
    digest = hashlib.blake2b(digest_size=32, person=b"kvferry-ctx")
    for slot in slots:
        digest.update(slot)
    return digest.digest()


def advance_state(state: bytes, slot: bytes) -> bytes:
    """Sampler state after the KV of one more token joined the context."""
    return hashlib.blake2b(state + slot, digest_size=32).digest()


def sample(state: bytes, produced: int, *, ignore_eos: bool = False) -> int:
    """The next token: EOS now and then, else a printable ASCII byte."""
    if not ignore_eos and produced >= MIN_ANSWER_TOKENS and state[0] % STOP_ONE_IN == 0:
        return EOS_TOKEN_ID
    choice = state[1] % 32
    if choice < 26:
        return ord("a") + choice
    if produced == 0:
        return ord("a") + state[2] % 26
    return ord(" ") if choice < 31 else ord(".")

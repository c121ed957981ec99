"""vLLM's chained ``sha256_cbor`` block hashes, computed without a CBOR library call per block.

Produces exactly the digests of ``kvferry.blockhash.block_hashes`` (sha256 over
canonical CBOR of ``(parent, tuple(tokens), None)``), but writes the CBOR bytes
itself: a block's encoding is a fixed head (3-array, parent bytes, n-array),
the tokens' precomputed encodings and ``null``. An engine hashes every prompt it
admits; with one ``cbor2.dumps`` per 16-token block that was milliseconds of
CPU per long prompt that no timing model counts. Tokens without a precomputed
encoding (outside ``0 .. _TABLE_SIZE - 1``) fall back to ``cbor2`` for their block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvferry.blockhash import hash_block_tokens

_TABLE_SIZE = 1 << 16


def _cbor_head(major: int, value: int) -> bytes:
    """Canonical (shortest) CBOR head of a major type with an unsigned argument."""
    if value < 24:
        return bytes([major << 5 | value])
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | code]) + value.to_bytes(size, "big")
    raise ValueError(f"{value} does not fit a CBOR head")


#: Canonical CBOR of each unsigned integer below _TABLE_SIZE, by value (a dict, so that
#: negative ids miss instead of indexing from the end).
_TOKEN_CBOR: dict[int, bytes] = {t: _cbor_head(0, t) for t in range(_TABLE_SIZE)}
_NULL = b"\xf6"
_SHA256_BYTES = 32


class BlockHasher:
    """Chained block hashes for one block size and one NONE_HASH root.

    Remembers the digests it computed (about the last ``memo_blocks`` to
    ``2 * memo_blocks`` blocks): the next turn of a conversation repeats the
    previous turn's whole sequence, and a digest is a pure function of the
    parent digest and the block's tokens, so those blocks are looked up instead
    of hashed again. Blocks with a token outside ``0 .. 255`` are not remembered.
    """

    def __init__(
        self, block_size: int, root: bytes, *, memo_blocks: int = 1 << 16, memo_prompts: int = 64
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.root = root
        self._array_head = _cbor_head(4, block_size)
        self._parent_heads: dict[int, bytes] = {}
        self._memo_blocks = memo_blocks
        self._recent: dict[bytes, bytes] = {}
        # Recent prompts by their first block's tokens (newest last), with their digests.
        self._prompts: dict[tuple[int, ...], tuple[list[int], list[bytes]]] = {}
        self._memo_prompts = memo_prompts
        self._older: dict[bytes, bytes] = {}

    def _parent_head(self, parent: bytes) -> bytes:
        head = self._parent_heads.get(len(parent))
        if head is None:
            head = self._parent_heads[len(parent)] = b"\x83" + _cbor_head(2, len(parent))
        return head

    def hash_prompt(self, tokens: list[int], cache_salt: str | None = None) -> list[bytes]:
        """``hash_blocks(tokens)`` for a whole prompt, starting from the longest prefix it
        shares with a prompt hashed before that began with the same block.

        A conversation's next turn repeats the previous prompt: comparing the token
        lists (in C) and copying its digests costs ~0.2 ms at 64k tokens, looking each
        block up in the memo 1.5 ms (on every long request, in no timing model).

        With a `cache_salt` the first block's hash has it as its extra key, as vLLM's
        (``generate_block_hash_extra_keys``), so the whole chain is the salt's own.
        """
        bs = self.block_size
        if cache_salt is not None:
            if len(tokens) < bs:
                return []
            first = hash_block_tokens(None, tokens[:bs], (cache_salt,), root=self.root)
            return [first, *self.hash_blocks(tokens[bs:], parent=first)]
        key = tuple(tokens[:bs])
        known = self._prompts.pop(key, None)
        hashes: list[bytes] = []
        if known is not None:
            before, before_hashes = known
            lo, hi = 0, min(len(before_hashes), len(tokens) // bs)
            if tokens[: hi * bs] == before[: hi * bs]:
                lo = hi
            while lo < hi:  # the most leading blocks the two agree on
                mid = (lo + hi + 1) // 2
                if tokens[: mid * bs] == before[: mid * bs]:
                    lo = mid
                else:
                    hi = mid - 1
            hashes = before_hashes[:lo]
        hashes += self.hash_blocks(tokens[len(hashes) * bs :], parent=hashes[-1] if hashes else None)
        self._prompts[key] = (tokens, hashes)
        while len(self._prompts) > self._memo_prompts:
            del self._prompts[next(iter(self._prompts))]
        return hashes[:]  # the remembered list stays the caller's to keep, not to change

    def hash_blocks(self, tokens: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Digests of every full block of ``tokens`` (int token ids; a partial tail has
        none), chained on ``parent`` (None: the first block of a sequence)."""
        bs = self.block_size
        encode = _TOKEN_CBOR.__getitem__
        sha256 = hashlib.sha256
        array_head, tail = self._array_head, _NULL
        previous = self.root if parent is None else parent
        parent_head = self._parent_head(previous)
        digest_head = self._parent_head(bytes(_SHA256_BYTES))
        # A memo key is the parent digest and one byte per token: unambiguous while every
        # parent has the same length, which every digest has (the first parent may not).
        memo = len(previous) == _SHA256_BYTES
        # After the first block the memo misses, the rest of a chain almost always misses
        # too (their parents are new): stop looking, keep remembering.
        looking = True
        recent, older = self._recent, self._older
        hashes: list[bytes] = []
        append = hashes.append
        for start in range(0, len(tokens) - bs + 1, bs):
            chunk = tokens[start : start + bs]
            key = None
            if memo:
                try:
                    key = previous + bytes(chunk)
                except (ValueError, TypeError):
                    pass
                else:
                    if looking:
                        known = recent.get(key)
                        if known is None and (known := older.get(key)) is not None:
                            recent[key] = known
                        if known is not None:
                            previous = known
                            append(known)
                            continue
                        looking = False
            try:
                body = b"".join(map(encode, chunk))
            except (KeyError, TypeError):
                previous = hash_block_tokens(previous, chunk)
            else:
                previous = sha256(parent_head + previous + array_head + body + tail).digest()
            if key is not None:
                recent[key] = previous
                if len(recent) >= self._memo_blocks:
                    self._older, self._recent = recent, {}
                    older, recent = self._older, self._recent
            parent_head, memo = digest_head, True  # every later parent is a sha256 digest
            append(previous)
        return hashes

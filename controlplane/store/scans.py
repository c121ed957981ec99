"""Reading the whole retention prefix without stalling etcd: listings and the gauge scan.

etcd 3.5 counts every key up to a range's end even when the range has a limit, holding
the index lock that writes wait for: paging through the whole prefix costs O(all
retentions) per page (11 ms at 170k keys) and stalls claims. So both read bounded
windows instead: the key of every page-th retention seen by the previous gauge scan
(kept in etcd, so a restarted or second replica starts with them), and of every page-th
one registered here since, split the prefix into windows of about a page each, and a
request costs O(its window). Stale bounds only make windows uneven; together they
always cover the whole prefix.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from aetcd import rpc

from controlplane.records import (
    HeldSummary,
    Keys,
    decode_bounds,
    decode_retention,
    decode_summary,
    encode_bounds,
    prefix_end,
)
from controlplane.store.kv import EtcdKv, decoded, get, put_op
from controlplane.store.retentions import Stored
from kvferry.decoding import UNDECODABLE

log = structlog.get_logger(__name__)

#: Retentions per gauge-scan request: the daemon's loop is busy while it receives and
#: decodes a page (~10 us a record), and lookups wait behind it.
SCAN_PAGE = 100
#: At most this many gauge-scan window bounds are kept (~50 bytes each in etcd).
MAX_SCAN_BOUNDS = 10_000


@dataclass(frozen=True)
class Scanned:
    """One retention as the gauge scan reads it."""

    tenant: str
    conversation_id: str
    revision: int
    held: HeldSummary


class RetentionScans:
    """Window bounds over the retention prefix, and the reads that use them."""

    def __init__(self, kv: EtcdKv, keys: Keys) -> None:
        self._kv = kv
        self._keys = keys
        # Every SCAN_PAGE-th key this replica registered since the last gauge scan.
        self._registered = 0
        self._sampled: list[bytes] = []
        # Window bounds for listings: the last gauge scan's (None: not read from etcd
        # yet), and those merged with the first `_merged` keys of `_sampled`.
        self._scan_bounds: list[bytes] | None = None
        self._bounds: list[bytes] | None = None
        self._merged = 0

    def sample(self, key: bytes) -> None:
        """Note a retention key being registered: every SCAN_PAGE-th is a window bound
        until the next gauge scan."""
        self._registered += 1
        if self._registered % SCAN_PAGE == 0 and len(self._sampled) < MAX_SCAN_BOUNDS:
            self._sampled.append(key)

    async def page(self, prefix: bytes, start: bytes, limit: int) -> tuple[list[Stored], bytes]:
        """Up to `limit` retentions under `prefix` from key `start`. -> (page, next start or b"").

        Read window by window between the bounds: one range to the prefix's end would
        cost O(every key after `start`) in etcd 3.5 (4 ms a page at 200k keys, under the
        lock claims wait for), a window O(~100).
        """
        end = prefix_end(prefix)
        key = start or prefix
        bounds = await self._window_bounds()  # this listing's own snapshot: never changed
        out: list[Stored] = []
        span = 1  # bounds a window spans: doubles over empty windows (stale bounds)
        while True:
            i = bisect.bisect_right(bounds, key) + span - 1
            hi = bounds[i] if i < len(bounds) and bounds[i] < end else end
            resp = await self._kv.range("list", get(key, hi, limit - len(out)))
            for kv in resp.kvs:
                tenant, conv = self._keys.split_retention(kv.key)
                retention = decoded(decode_retention, kv)
                if retention is not None:
                    out.append(Stored(tenant, conv, retention, int(kv.mod_revision)))
            if resp.more and resp.kvs:
                return out, bytes(resp.kvs[-1].key) + b"\0"
            if hi == end:
                return out, b""
            if len(out) >= limit:
                return out, hi
            key, span = hi, 1 if resp.kvs else span * 2

    async def _window_bounds(self) -> list[bytes]:
        """The last scan's bounds and the keys sampled since, sorted: a new list whenever
        samples were added (a listing in progress keeps the one it started with)."""
        if self._scan_bounds is None:
            self._scan_bounds = await self._load_bounds()
        # (A long sorted run and a short one: Timsort merges them in about linear time.
        # A key sampled twice only makes one empty window.)
        if self._bounds is None:
            self._bounds = sorted(self._scan_bounds + self._sampled)
        elif self._merged < len(self._sampled):
            self._bounds = sorted(self._bounds + self._sampled[self._merged :])
        self._merged = len(self._sampled)
        return self._bounds

    async def scan_held(self, pause_s: float) -> AsyncIterator[Scanned]:
        """Every retention's key, revision, engine, size and times, about SCAN_PAGE at a time, pausing
        between requests; the bounds it finds are kept in etcd for the next scan."""
        page = SCAN_PAGE
        prefix = self._keys.retentions
        sampled, self._sampled, self._merged = self._sampled, [], 0
        known = sorted({*await self._load_bounds(), *sampled})
        edges = [prefix, *known, prefix_end(prefix)]
        bounds: list[bytes] = []
        seen = 0
        for lo, hi in itertools.pairwise(edges):
            start = lo
            while True:
                resp = await self._kv.range("scan", rpc.RangeRequest(key=start, range_end=hi, limit=page))
                for kv in resp.kvs:
                    if seen and seen % page == 0:
                        bounds.append(bytes(kv.key))
                    seen += 1
                    summary = decoded(decode_summary, kv)
                    if summary is not None:
                        tenant, conversation = self._keys.split_retention(kv.key)
                        yield Scanned(tenant, conversation, int(kv.mod_revision), summary)
                # Paced by what was read: a window that came back (nearly) empty costs
                # one cheap request, and sampled bounds never slow the scan down.
                await asyncio.sleep(pause_s * len(resp.kvs) / page)
                if not (resp.more and resp.kvs):
                    break
                start = bytes(resp.kvs[-1].key) + b"\0"
        # Very large stores: fewer, larger windows, so the bounds stay one modest value.
        step = max(1, -(-len(bounds) // MAX_SCAN_BOUNDS))
        self._scan_bounds, self._bounds = bounds[::step], None
        await self._kv.txn(
            "scan_bounds", [], [put_op(self._keys.scan_bounds, encode_bounds(self._scan_bounds))], []
        )

    async def _load_bounds(self) -> list[bytes]:
        """The previous scan's window bounds: strictly increasing keys inside the prefix,
        or none (a value that is not is ignored, with a log line)."""
        (resp,) = await self._kv.read("scan_bounds", get(self._keys.scan_bounds))
        kvs = resp.kvs
        if not kvs:
            return []
        try:
            bounds = decode_bounds(kvs[0].value)
        except UNDECODABLE as e:
            log.warning("scan_bounds.invalid", error=str(e))
            return []
        prefix, end = self._keys.retentions, prefix_end(self._keys.retentions)
        if not all(prefix < b < end for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            log.warning("scan_bounds.invalid", error="bounds not increasing inside the retention prefix")
            return []
        return bounds

"""The etcd leases that garbage-collect retentions and claim markers after their deadline.

Deadlines are grouped into time buckets, one shared etcd lease per bucket (DESIGN.md):
grants grow with the registration rate, never with the number of live records, and a
deadline itself lives in the record's value (enforced at lookup, not by etcd).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aetcd import rpc

from controlplane import metrics
from controlplane.errors import StoreUnavailable
from controlplane.etcd import Client, LeaseGone, timed

T = TypeVar("T")


class GcLeases:
    """Shared etcd leases that garbage-collect records after their deadline.

    Deadlines are grouped into buckets of `bucket_s` seconds; every record whose
    deadline falls in a bucket is attached to that bucket's etcd lease, which expires
    one bucket after the bucket ends. An etcd lease carries at most `max_keys` records
    (a full bucket gets another one).
    """

    def __init__(self, client: Client, bucket_s: int, max_keys: int, timeout: float) -> None:
        self._client = client
        self._bucket_s = bucket_s
        self._max_keys = max_keys
        self._timeout = timeout
        self._leases: dict[int, tuple[int, int]] = {}  # bucket -> (etcd lease id, keys attached)
        self._granting: dict[int, asyncio.Future[int]] = {}

    async def lease_for(self, deadline: float, now: float) -> int:
        """The etcd lease a record with `deadline` goes on (granted when its bucket has none)."""
        bucket = math.ceil(deadline / self._bucket_s)
        held = self._leases.get(bucket)
        if held is not None and held[1] < self._max_keys:
            self._leases[bucket] = (held[0], held[1] + 1)
            return held[0]
        pending = self._granting.get(bucket)
        if pending is not None:
            # Wait for the grant in flight (never cancelling it), then take the lease from the
            # table, or ask again: its caller being cancelled is no reason to fail this one.
            await asyncio.wait([pending])
            if not pending.cancelled() and (failed := pending.exception()) is not None:
                raise failed  # etcd refused or is down: the same answer for everyone waiting
            return await self.lease_for(deadline, now)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._granting[bucket] = fut
        try:
            ttl = max(1, math.ceil(bucket * self._bucket_s - now) + self._bucket_s)
            resp = await timed(
                "lease_grant",
                self._client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl), timeout=self._timeout),
            )
            metrics.GC_LEASE_GRANTS.inc()
            self._leases[bucket] = (resp.ID, 1)
            fut.set_result(resp.ID)
            self._forget_before(math.floor(now / self._bucket_s))
            return int(resp.ID)
        except asyncio.CancelledError:
            fut.cancel()  # this caller gave up: the waiters ask again
            raise
        except Exception as e:
            fut.set_exception(e)
            fut.exception()  # (retrieved: a grant nobody waited for is not an unhandled error)
            raise
        finally:
            del self._granting[bucket]

    async def write_on_lease(self, deadline: float, now: float, write: Callable[[int], Awaitable[T]]) -> T:
        """`write(lease)` on the etcd lease for `deadline`; when etcd no longer knows that
        lease (a cluster restore), it is forgotten and the write made once more on a new one."""
        lease = await self.lease_for(deadline, now)
        try:
            return await write(lease)
        except LeaseGone:
            self.forget(lease)
            lease = await self.lease_for(deadline, now)
            try:
                return await write(lease)
            except LeaseGone as e:
                raise StoreUnavailable("etcd lost the GC lease twice in a row") from e

    def forget(self, lease_id: int) -> None:
        """Drop an etcd lease etcd no longer knows (e.g. after a cluster restore)."""
        self._leases = {b: v for b, v in self._leases.items() if v[0] != lease_id}

    def forget_all(self) -> None:
        """Drop every etcd lease known (a write named one etcd no longer knows)."""
        self._leases.clear()

    def _forget_before(self, bucket: int) -> None:
        for b in [b for b in self._leases if b < bucket]:
            del self._leases[b]

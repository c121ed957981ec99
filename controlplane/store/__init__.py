"""The etcd adapter: every etcd call the daemon makes, and nothing else.

Talks to etcd through aetcd (its client, generated etcd API and error types); hot
paths build the etcd requests directly so that each kvferry operation is one etcd
round trip. Library errors are translated at the boundary (controlplane.etcd) into the
project's own `StoreUnavailable` / `Conflict` (see errors.py).

One part per kind of record, on one connection (`EtcdStore`):

- kv.py: the etcd operations and request builders every part is built from;
- nodes.py: node records, liveness and the generation floor;
- retentions.py: retentions and claim markers (as records; claims are decided by the
  shard owners, controlplane.owners, which write them fenced);
- gcleases.py: the shared etcd leases that garbage-collect those;
- scans.py: listings and the gauge scan, in bounded windows;
- replicas.py: the daemon replicas' announcements.

etcd lease strategy (DESIGN.md): one liveness lease per node registration; retentions
and claim markers share time-bucketed GC leases, never one etcd lease per record.
Retention deadlines live in the values and are enforced at lookup; etcd leases only
garbage-collect.
"""

from __future__ import annotations

import asyncio
import time

from controlplane.errors import StoreUnavailable
from controlplane.etcd import Client, EtcdTls
from controlplane.notices import NoticeSender, Promises
from controlplane.records import Keys
from controlplane.solewriter import SoleWriter
from controlplane.store.gcleases import GcLeases
from controlplane.store.kv import EtcdKv, get
from controlplane.store.nodes import NodeStore
from controlplane.store.replicas import ReplicaStore
from controlplane.store.retentions import RetentionStore
from controlplane.store.scans import RetentionScans


class EtcdStore:
    """The daemon's records in etcd, one part per kind, on one client."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        keys: Keys,
        timeout_s: float,
        bucket_s: int,
        max_keys_per_lease: int,
        claim_marker_s: int,
        tls: EtcdTls | None = None,
    ) -> None:
        self.keys = keys
        self.endpoints = endpoints
        self._client = Client(endpoints, timeout_s, tls)
        self.kv = EtcdKv(self._client, timeout_s)
        self.writer = SoleWriter()
        """This replica's standing as a writer of node records (controlplane.solewriter)."""
        self.nodes = NodeStore(self.kv, keys, self.writer)
        self.promises = Promises()
        """The promises of notice this replica made to the others (controlplane.notices)."""
        self.notices = NoticeSender(self.promises, lambda: self.writer.me)
        """Tells the others of this replica's node demotions first (its transport: the daemon's)."""
        self.nodes.fenced.notices = self.notices
        self.scans = RetentionScans(self.kv, keys)
        self.gc = GcLeases(self._client, bucket_s, max_keys_per_lease, timeout_s)
        self.retentions = RetentionStore(self.kv, keys, self.gc, self.scans.sample, claim_marker_s)
        self.replicas = ReplicaStore(self.kv, keys, self.writer)

    async def connect(self) -> None:
        """Open the client's channel to etcd."""
        await self._client.connect()

    async def close(self) -> None:
        """Send what is queued for group commit, then close the client."""
        await self.nodes.close()
        await self.notices.close()
        await self.kv.batcher.close()
        await self._client.close()

    async def follow_dns(self, interval_s: float) -> None:
        """Keep resolving the endpoints' names (when gRPC would not): see `channel_target`."""
        await self._client.follow_dns(interval_s)

    async def follow_certs(self, interval_s: float) -> None:
        """Keep the etcd TLS files watched: a rotated certificate moves to a new channel."""
        await self._client.follow_certs(interval_s)

    async def ready(self, timeout_s: float) -> None:
        """Wait until etcd answers a read, or raise StoreUnavailable."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.kv.read("ready", get(self.keys.nodes, limit=1))
                return
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

"""Daemon replicas' announcements in etcd: ``replicas/<id>`` holds a replica's address,
on an etcd lease of its own (the key goes within its TTL of a crash). See peers.py; what
each announcement, keep-alive and read of them shows also goes to this replica's
SoleWriter (controlplane.solewriter)."""

from __future__ import annotations

import time

from controlplane.records import Keys, prefix_end
from controlplane.solewriter import SoleWriter
from controlplane.store.kv import EtcdKv, get, put_op


class ReplicaStore:
    """The announcements of the daemon replicas sharing one etcd prefix."""

    def __init__(self, kv: EtcdKv, keys: Keys, writer: SoleWriter) -> None:
        self._kv = kv
        self._keys = keys
        self._writer = writer

    async def announce(self, replica_id: str, address: str, ttl_s: int) -> int:
        """Announce replica `replica_id` at `address` under an etcd lease of its own. ->
        that lease (refresh it with `refresh`; the key goes when it lapses)."""
        self._writer.withdrawn()
        sent = time.monotonic()
        lease = await self._kv.grant("replica", ttl_s)
        try:
            await self._kv.txn(
                "replica", [], [put_op(self._keys.replica(replica_id), address.encode(), lease)], []
            )
        except BaseException:
            await self._kv.revoke_quietly(lease)
            raise
        self._writer.announced(replica_id, lease, sent, ttl_s)
        return lease

    async def refresh(self, lease_id: int) -> bool:
        """Refresh an announcement's etcd lease. -> False when it is gone (announce again)."""
        sent = time.monotonic()
        ttl = await self._kv.refresh(lease_id)
        self._writer.refreshed(lease_id, sent, ttl)
        return ttl > 0

    async def withdraw(self, lease_id: int) -> None:
        """Take an announcement away (revoking its etcd lease; a failure is only logged)."""
        self._writer.withdrawn()
        await self._kv.revoke_quietly(lease_id)

    async def announced(self) -> dict[str, str]:
        """The replicas announced now: id -> address."""
        keys = self._keys.replicas
        started = time.monotonic()
        [resp] = await self._kv.read("replicas", get(keys, prefix_end(keys)))
        found = {self._keys.replica_id(kv.key): kv.value.decode(errors="replace") for kv in resp.kvs}
        self._writer.saw(found, started)
        return found

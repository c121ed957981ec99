"""Daemon replicas' announcements in etcd: ``replicas/<id>`` holds a replica's address,
on an etcd lease of its own (the key goes within its TTL of a crash). See peers.py."""

from __future__ import annotations

from controlplane.records import Keys, prefix_end
from controlplane.store.kv import EtcdKv, get, put_op


class ReplicaStore:
    """The announcements of the daemon replicas sharing one etcd prefix."""

    def __init__(self, kv: EtcdKv, keys: Keys) -> None:
        self._kv = kv
        self._keys = keys

    async def announce(self, replica_id: str, address: str, ttl_s: int) -> int:
        """Announce replica `replica_id` at `address` under an etcd lease of its own. ->
        that lease (refresh it with `refresh`; the key goes when it lapses)."""
        lease = await self._kv.grant("replica", ttl_s)
        try:
            await self._kv.txn(
                "replica", [], [put_op(self._keys.replica(replica_id), address.encode(), lease)], []
            )
        except BaseException:
            await self._kv.revoke_quietly(lease)
            raise
        return lease

    async def refresh(self, lease_id: int) -> bool:
        """Refresh an announcement's etcd lease. -> False when it is gone (announce again)."""
        return await self._kv.refresh(lease_id) > 0

    async def withdraw(self, lease_id: int) -> None:
        """Take an announcement away (revoking its etcd lease; a failure is only logged)."""
        await self._kv.revoke_quietly(lease_id)

    async def announced(self) -> dict[str, str]:
        """The replicas announced now: id -> address."""
        keys = self._keys.replicas
        [resp] = await self._kv.read("replicas", get(keys, prefix_end(keys)))
        return {self._keys.replica_id(kv.key): kv.value.decode(errors="replace") for kv in resp.kvs}

"""Fixtures of the daemon's tests: a store of its own key prefix on the session's etcd."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from controlplane.records import Keys
from controlplane.store import EtcdStore


@pytest.fixture
async def store(etcd_endpoint: str) -> AsyncIterator[EtcdStore]:
    """An EtcdStore, connected and ready, under a fresh key prefix, its replica announced."""
    s = EtcdStore((etcd_endpoint,), Keys(f"/t-{uuid.uuid4().hex[:10]}"), 2.0, 60, 10_000, 600)
    await s.connect()
    await s.ready(10)
    # Announced alone, as a daemon's Peers does: it may write node records at once.
    await s.replicas.announce("test-replica", "", 30)
    await s.replicas.announced()
    yield s
    await s.close()

"""How long a holder of an etcd lease may act on it by its own clock: the shard owners'
validity (controlplane.owners) and a replica's standing as the sole node writer
(controlplane.solewriter). Pure: no I/O."""

from __future__ import annotations


def valid_until(sent_at: float, ttl_s: float, margin_s: float) -> float:
    """Until when (on the holder's monotonic clock) an etcd lease is provably alive, after
    etcd acknowledged a keep-alive (or the grant) of it sent at `sent_at`, the lease then
    having `ttl_s` left. etcd cannot expire the lease (and let another replica take what
    it holds: a shard, the announcement that fences node writes) before `sent_at +
    ttl_s`: the request reached it after it was sent. `margin_s` covers the two clocks'
    drift and the time a decision takes."""
    return sent_at + ttl_s - margin_s

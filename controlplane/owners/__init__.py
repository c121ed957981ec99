"""Claims decided in memory by the owner of each conversation's shard, made durable in
etcd behind the answer: single use without waiting for etcd's fsync on a lookup.

What is decided where
---------------------
A conversation (tenant, conversation_id) belongs to one of S shards (`--claim-shards`,
shards.shard_of: a stable hash). Each shard has at most one OWNER replica: the key
``owners/<shard>``, put on the owner's own etcd lease (`--owner-ttl`, kept alive) by a
transaction that requires it absent (durable.OwnerStore.take). Its create_revision is
the shard's FENCE: every etcd write for the shard carries the compare
`create_revision(owners/<shard>) == fence`, so a deposed owner writes nothing.

From taking a shard on, its owner's memory (memory.ShardMemory) is the truth for it and
etcd the durable copy. A shard never owned, or left cleanly, is exactly as etcd holds it,
and nobody else writes it: each conversation is read from etcd (linearizably, once) when
an operation first touches it, then decided in memory; so a restart does not wait for
every retention to load. (Only an unclean takeover reads the whole shard: see below.)
Every operation that takes, replaces or reads a retention runs at the owner (routed.py;
another replica forwards it over the daemon-only Owners RPC, kvferry.v1.Owners):

- a claim is decided in memory (no await between the check and the take) and answered
  at once; its writes (delete the retention, put the marker) go to the write-behind
  queue (writeback.py), group-committed and fenced;
- a registration (memory says whether the retention it replaces was ever claimed), a
  put-back, a revoke or conversation end, a budget release (`revoke_exact`) and a claim's
  deadline note are decided in memory the same way, queued in the same order behind
  every pending write of the shard, and answered once written (write-through);
- Get (and a peek lookup) read the owner's memory; List, the gauge scan and the budget
  rescans read etcd, which may be a write-behind (milliseconds) behind.

So a lookup waits for no etcd write. Its decode node's state before a pull comes from this
replica's view of the nodes (service/nodecache.py). A replica that provably wrote every
node change since its last read of etcd (one replica alone: controlplane.solewriter)
decides on that view with no etcd request at all. Beside other replicas, the pull is
confirmed by a serializable read shared by that node's lookups for 50 ms; such a read is
not behind etcd's WAL fsync, but it is behind the fsync of a backend commit: etcd holds
its read lock while bbolt commits (every 100 ms by default), so a slow commit holds every
read, serializable or not. bench.fsync_tail measures that tail.

A single replica owns every shard, and nothing is forwarded. Several replicas share them:
each takes free shards up to its fair share (ceil(S / live replicas)) and hands the rest
over cleanly; an operation on a shard nobody owns takes it at once.

Validity
--------
The owner decides for its shards only while its ownership is provably live by its own
monotonic clock: until the send time of the last keep-alive etcd acknowledged plus the
TTL it then had, less a margin (owner.ShardOwners.valid). etcd cannot expire the lease,
and so free the shard for another replica, before that instant. Past it (etcd out of
reach, the process paused by SIGSTOP), operations wait up to a second for a keep-alive
and then answer store_unavailable. Acknowledged again, the lease still holds every owner
key (only this replica deletes them, fenced), so deciding goes on with memory as it was;
a lease found gone drops every shard, its memory and its queued writes.

Why a retention is never handed out twice
------------------------------------------
Within one ownership, memory decides and a retention leaves memory when it is claimed.
Between owners: a new owner exists only after the old one's lease expired in etcd (after
the old one stopped deciding, by its validity) or after it handed the shard over
cleanly (every write flushed first). A CLEAN handover (``shardstate/<shard>``
clean=true) leaves etcd exactly as the old memory was, and the new owner loads it. An
UNCLEAN one (the state still says clean=false: the old owner crashed, hung or lost etcd)
leaves etcd behind what the old owner answered: any retention present may have been
handed out from memory. So the new owner treats EVERY retention of the shard present at
takeover as spent: it deletes them (fenced, ahead of any other write), never hands them
out, and after a grace (`OwnerSettings.grace_s`, for a pull the old owner answered to
finish) has their decode nodes free the blocks (Budgets.queue, reason "failover", told
through the replica each node is attached to: service/relay.py;
counted in kvferry_failover_retentions_total and kvferry_retention_releases_total).
Its old writes, if they ever arrive, fail the fence.

The grace covers a pull only if the pull starts soon after the old owner decided it: an
owner paused after deciding (SIGSTOP, a VM stall) and resumed after the takeover still
sends its answer. So clients use an answer at most `kvferry.limits.ANSWER_VALID_S` (3 s)
after their lookup left (`kvferry.leaseclient`: a later one goes to the caller's late
hook, which releases). The old owner decided after the lookup left, and stopped deciding
at least `margin_s` before its lease could lapse. The release comes `grace_s` after the
lapse or later, so at least 6 s after the decision, and any pull starts 3 s or more
before it (settings refuse a grace that is not longer than ANSWER_VALID_S).

What a failover costs
---------------------
Every live retention of the shards the failed owner held is lost to reuse (those turns
recompute), and their blocks stay pinned for the grace; a registration or put-back the
old owner had in memory but not yet in etcd is lost too (D frees those blocks at its
TTL), and a release already told to a caller may be told again (freeing a request's
blocks twice is harmless to D). A clean stop (SIGTERM) hands every shard over and costs
nothing. A restart of the same process after an unclean loss is a failover too: it does
not try to prove its old memory current.

Every replica of a deployment must decide claims this way: a replica of an older
version (claims as etcd transactions) beside owners would hand out what an owner's
memory still holds. Upgrade by stopping the old replicas first.
"""

from controlplane.owners.durable import OwnerStore
from controlplane.owners.owner import ShardOwners
from controlplane.owners.routed import Forwarder, NotOwner, OwnedRetentions
from controlplane.settings import OwnerSettings

__all__ = ["Forwarder", "NotOwner", "OwnedRetentions", "OwnerSettings", "OwnerStore", "ShardOwners"]

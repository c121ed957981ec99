"""The daemon's domain errors. The gRPC layer maps each to one status code, in one place
(controlplane.server.status)."""

from __future__ import annotations


class KvferryError(Exception):
    """Base of every error the daemon reports to a caller."""


class InvalidArgument(KvferryError):
    """The request is malformed; the message names the field."""


class NotFound(KvferryError):
    """What the request names does not exist (a node, a retention)."""


class FailedPrecondition(KvferryError):
    """The request is well-formed but the system is not in a state to apply it."""


class ResourceExhausted(KvferryError):
    """The caller has more in flight than the daemon takes at once; it may retry once some
    of it is answered."""


class PermissionDenied(KvferryError):
    """The caller is known, but its role, tenants or node do not cover what it asked."""


class StoreUnavailable(KvferryError):
    """etcd did not answer (down, no quorum, timed out). What the operation wrote is not
    known: etcd may have applied it, or may apply it yet."""


class NotApplied(StoreUnavailable):
    """etcd, or the replica owning the operation's shard, could not take the operation
    now, and it was turned away before anything was decided or written: sending it again
    is safe. (Raised only where that is proven; any other failure stays StoreUnavailable.)"""


class Conflict(KvferryError):
    """A compare-and-swap lost a race; the caller may retry."""


def not_applied(error: StoreUnavailable) -> NotApplied:
    """`error`, raised before the operation was decided: then nothing was applied."""
    return error if isinstance(error, NotApplied) else NotApplied(f"not applied: {error}")

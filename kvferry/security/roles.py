"""Roles and what each may do: pure decisions over plain data, no I/O.

A caller is named by its client certificate's Common Name or by a bearer token listed in
the policy file, and holds one role. Three questions are asked of it:

- `method_denial`: may it call this gRPC method at all?
- `tenant_denial`: may it see and use this tenant's retentions (digests, D addresses)?
- `node_denial`: may it speak for this engine (register it, heartbeat it, register
  retentions of its blocks)?

Each answers None (allowed) or a `Denial` whose message says what was missing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Literal

ALL_TENANTS = "*"
"""In a caller's tenants: every tenant."""

LEASES = "/kvferry.v1.Leases/"
NODES = "/kvferry.v1.Nodes/"
OWNERS = "/kvferry.v1.Owners/"
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")


class Role(enum.StrEnum):
    """What a caller is. The policy file names roles by these values."""

    ADMIN = "admin"
    """An operator: every method, every tenant, every node."""
    READER = "reader"
    """Dashboards and on-call reading: Get, List (its tenants) and the node list."""
    ROUTER = "router"
    """A front door: lookups (its tenants), node list and scores, where each conversation's
    lookups are decided (Leases/Routes), and the end of its tenants' conversations (a
    Revoke with conversation_end)."""
    SIDECAR = "sidecar"
    """The sidecar of one engine: registers that engine and its retentions."""
    DAEMON = "daemon"
    """A peer daemon replica: the fan-out of node lists and scores, the operations
    forwarded to a claim shard's owner (Owners/Apply), the releases forwarded to the
    replica a decode node is attached to (Owners/Release), and the promised notices of
    node demotions (Owners/PromiseNotice, NodeDemoting, NodeDemoted)."""


_READ = frozenset({f"{LEASES}Get", f"{LEASES}List", f"{NODES}List"})
ALLOWED: dict[Role, frozenset[str]] = {
    Role.READER: _READ,
    Role.ROUTER: _READ
    | {f"{LEASES}{m}" for m in ("Lookup", "Stream", "Revoke", "Routes")}
    | {f"{NODES}Score"},
    Role.SIDECAR: frozenset(
        {
            f"{NODES}Register",
            f"{NODES}Attach",
            f"{NODES}List",
            f"{LEASES}Register",
            f"{LEASES}Stream",
            f"{LEASES}Held",  # (of its own node's pins: node_denial)
        }
    ),
    Role.DAEMON: frozenset(
        {f"{NODES}Score", f"{NODES}List"}
        | {f"{OWNERS}{m}" for m in ("Apply", "Release", "PromiseNotice", "NodeDemoting", "NodeDemoted")}
    ),
}
"""Methods each role other than admin may call (admin: all). Leases/Stream carries lookups
and registrations: each operation is checked again (`stream_op_denial`)."""

_TENANTED = frozenset({Role.ADMIN, Role.READER, Role.ROUTER})
_STREAM_OPS: dict[Role, frozenset[str]] = {
    Role.ROUTER: frozenset({"lookup", "prompt"}),
    Role.SIDECAR: frozenset({"register"}),
}


@dataclass(frozen=True)
class Caller:
    """Whom a request runs as."""

    name: str
    """The identity: a certificate's Common Name or a policy identity's name."""
    role: Role
    node: str = ""
    """For a sidecar: the engine id it speaks for."""
    tenants: frozenset[str] = field(default_factory=frozenset)
    """For a router or reader: the tenants it may act for (ALL_TENANTS = all)."""

    DEVELOPMENT: ClassVar[Caller]
    """Every caller in development mode (no policy): an admin."""

    def describe(self) -> str:
        return f"identity {self.name!r} (role {self.role.value})"

    def all_tenants(self) -> bool:
        return self.role is Role.ADMIN or ALL_TENANTS in self.tenants


Caller.DEVELOPMENT = Caller("development", Role.ADMIN)


@dataclass(frozen=True)
class Denial:
    """Why a caller is refused; `code` picks UNAUTHENTICATED (401) or PERMISSION_DENIED (403)."""

    code: Literal["unauthenticated", "permission_denied"]
    message: str


def anonymous(what: str) -> Denial:
    """The caller presented nothing: `what` names what it should have."""
    return Denial("unauthenticated", f"no identity: {what}")


def method_denial(caller: Caller | None, method: str) -> Denial | None:
    """May `caller` (None = anonymous) call the gRPC `method` ("/pkg.Service/Method")?"""
    if method.startswith(HEALTH):
        return None
    if caller is None:
        return anonymous(f"{method} needs a client certificate or a bearer token of the policy")
    if caller.role is Role.ADMIN or method.startswith(REFLECTION):
        return None
    if method in ALLOWED[caller.role]:
        return None
    needs = [*sorted(r.value for r, methods in ALLOWED.items() if method in methods), "admin"]
    return Denial(
        "permission_denied", f"{caller.describe()} may not call {method}: it needs role {' or '.join(needs)}"
    )


def stream_op_denial(caller: Caller, op: str) -> Denial | None:
    """May `caller` send a Leases/Stream operation of kind `op` ("lookup", "prompt", "register")?"""
    if caller.role is Role.ADMIN or op in _STREAM_OPS.get(caller.role, frozenset()):
        return None
    return Denial("permission_denied", f"{caller.describe()} may not send {op} operations on Leases/Stream")


def tenant_denial(caller: Caller, tenant: str) -> Denial | None:
    """May `caller` see and use `tenant`'s retentions (their digests and D addresses)?"""
    if caller.all_tenants() or (caller.role in _TENANTED and tenant in caller.tenants):
        return None
    if caller.role not in _TENANTED:
        return Denial("permission_denied", f"{caller.describe()} may not read retentions of any tenant")
    return Denial("permission_denied", f"{caller.describe()} may not act for tenant {tenant!r}")


def revoke_denial(caller: Caller, tenant: str, conversation_end: bool) -> Denial | None:
    """May `caller` revoke a retention of `tenant`? An admin any; a router only its own
    tenants', and only as a conversation's end (its client asked for it)."""
    if caller.role is Role.ADMIN:
        return None
    if caller.role is Role.ROUTER and not conversation_end:
        return Denial(
            "permission_denied",
            f"{caller.describe()} may revoke a retention only as a conversation's end (conversation_end)",
        )
    return tenant_denial(caller, tenant)


def all_tenants_denial(caller: Caller) -> Denial | None:
    """May `caller` list every tenant's retentions at once?"""
    if caller.all_tenants():
        return None
    return Denial("permission_denied", f"{caller.describe()} may not list all tenants: it needs role admin")


def node_denial(caller: Caller, node_id: str) -> Denial | None:
    """May `caller` speak for engine `node_id` (register it, heartbeat it, register its retentions)?"""
    if caller.role is Role.ADMIN or (caller.role is Role.SIDECAR and caller.node == node_id):
        return None
    if caller.role is Role.SIDECAR:
        return Denial(
            "permission_denied",
            f"{caller.describe()} may speak only for node {caller.node!r}, not {node_id!r}",
        )
    return Denial(
        "permission_denied", f"{caller.describe()} may not speak for node {node_id!r}: only its sidecar may"
    )


def admin_denial(caller: Caller | None, action: str) -> Denial | None:
    """May `caller` perform the administrative `action` (a sidecar admin path, say)?"""
    if caller is None:
        return anonymous(f"{action} needs an admin's client certificate or bearer token")
    if caller.role is Role.ADMIN:
        return None
    return Denial("permission_denied", f"{caller.describe()} may not {action}: it needs role admin")

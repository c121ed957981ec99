"""The audit trail: one structured log line per refusal and per allowed administrative act.

Lines go to the `kvferry.audit` logger (JSON when not on a terminal), so a deployment can
ship them apart from the rest: event `audit.denied` or `audit.allowed`, with the caller's
identity ("-" for anonymous), what it tried, the peer address and, for a refusal, why.
"""

from __future__ import annotations

import structlog

from kvferry.security.roles import Caller, Denial

log = structlog.get_logger("kvferry.audit")


def denied(caller: Caller | None, action: str, denial: Denial, peer: str = "") -> None:
    """Record that `caller` was refused `action` (a gRPC method or an HTTP method and path)."""
    log.warning(
        "audit.denied",
        identity=caller.name if caller else "-",
        role=caller.role.value if caller else "-",
        action=action,
        code=denial.code,
        reason=denial.message,
        peer=peer,
    )


def allowed(caller: Caller, action: str, peer: str = "", **details: object) -> None:
    """Record an administrative act that was allowed (a revoke, a deregister, an engine admin path)."""
    log.info(
        "audit.allowed", identity=caller.name, role=caller.role.value, action=action, peer=peer, **details
    )

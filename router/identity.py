"""Who is talking and about which conversation, from a request's headers and body. Pure.

The conversation is the one `kvferry.turnheaders.conversation_of` reads (D's
sidecar reads it the same way). No conversation: plain P/D serving.

Tenant: the client's API key (``Authorization: Bearer ...``) hashed, never the
key itself; without a key, the tenant header when one is configured; else the
daemon's default tenant. A key wins over the header so that a client cannot
name another tenant's conversations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.turnheaders import conversation_of, key_tenant, named_tenant


@dataclass(frozen=True)
class Identity:
    """A request's tenant ("" = default) and conversation ("" = none)."""

    tenant: str
    conversation_id: str


def api_key_of(headers: Mapping[str, str]) -> str:
    """The bearer key of a request ("" = none)."""
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def tenant_of(headers: Mapping[str, str], tenant_header: str) -> str:
    """The tenant a request belongs to ("" = the daemon's default tenant)."""
    key = api_key_of(headers)
    if key:
        return key_tenant(key)
    return named_tenant(headers, tenant_header) if tenant_header else ""


def identify(headers: Mapping[str, str], body: Mapping[str, Any], tenant_header: str) -> Identity:
    """Tenant and conversation of one request."""
    conversation = conversation_of(headers, body)
    return Identity(tenant_of(headers, tenant_header) if conversation else "", conversation)

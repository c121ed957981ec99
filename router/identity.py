"""Who is talking and about which conversation, from a request's headers and body. Pure.

Conversation identity, first found wins (the sidecar reads the same order):
header ``X-Conversation-Id``, body ``conversation_id`` (vLLM's multi-turn
benchmark with ``--send-conversation-id``, and vLLM's multi-turn proxy), header
``X-Session-ID`` (the same benchmark), body ``session_id`` (vLLM's own field).
No identity: plain P/D serving.

Tenant: the client's API key (``Authorization: Bearer ...``) hashed, never the
key itself; without a key, the tenant header when one is configured; else the
daemon's default tenant. A key wins over the header so that a client cannot
name another tenant's conversations.

Identifiers the daemon would refuse (too long, control characters) are replaced
by a digest of themselves: still stable across turns, never an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.ids import MAX_ID_BYTES

CONVERSATION_HEADER = "X-Conversation-Id"
SESSION_HEADER = "X-Session-ID"
_KEY_TENANT = "key-"  # the tenants named after an API key


@dataclass(frozen=True)
class Identity:
    """A request's tenant ("" = default) and conversation ("" = none)."""

    tenant: str
    conversation_id: str


def _unprintable(c: str) -> bool:
    # Control characters, and the surrogates aiohttp decodes a header's non-UTF-8 bytes to
    # (surrogateescape): protobuf refuses to send those.
    return ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF


def safe_id(value: str, kind: str, digest: bool = False) -> str:
    """`value` as the daemon accepts it: itself, or (`digest`, or when too long or
    unprintable) a digest of it."""
    raw = value.encode(errors="surrogatepass")
    if not digest and len(raw) <= MAX_ID_BYTES and not any(map(_unprintable, value)):
        return value
    return f"{kind}-{hashlib.sha256(raw).hexdigest()[:32]}"


def _id_value(value: object) -> str:
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return ""


def conversation_of(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """The conversation a request names ("" = none)."""
    for value in (
        headers.get(CONVERSATION_HEADER),
        body.get("conversation_id"),
        headers.get(SESSION_HEADER),
        body.get("session_id"),
    ):
        found = _id_value(value)
        if found:
            return safe_id(found, "conv")
    return ""


def api_key_of(headers: Mapping[str, str]) -> str:
    """The bearer key of a request ("" = none)."""
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def tenant_of(headers: Mapping[str, str], tenant_header: str) -> str:
    """The tenant a request belongs to ("" = the daemon's default tenant)."""
    key = api_key_of(headers)
    if key:
        raw = key.encode(errors="surrogatepass")
        return _KEY_TENANT + hashlib.blake2b(raw, digest_size=12, person=b"kvferry-tenant").hexdigest()
    if tenant_header:
        named = headers.get(tenant_header, "").strip()
        # (never a key's tenant: a name like one is taken as a digest of itself)
        return safe_id(named, "tenant", digest=named.startswith(_KEY_TENANT))
    return ""


def identify(headers: Mapping[str, str], body: Mapping[str, Any], tenant_header: str) -> Identity:
    """Tenant and conversation of one request."""
    conversation = conversation_of(headers, body)
    return Identity(tenant_of(headers, tenant_header) if conversation else "", conversation)

"""The headers of a turn between kvferry's router and its sidecars, and the rules both read
a request by: the one home of that contract. Pure.

Conversation identity, first found wins: header ``X-Conversation-Id``, body
``conversation_id`` (vLLM's multi-turn benchmark with ``--send-conversation-id``,
and vLLM's multi-turn proxy), header ``X-Session-ID`` (the same benchmark), body
``session_id`` (vLLM's own field). None: plain P/D serving. An id the daemon would
refuse (too long, control characters) is replaced by a digest of itself: still
stable across turns, never an error. The router names the conversation to D's
sidecar in ``X-Conversation-Id``, already made safe (the rule keeps a safe id as it is).

Tenant: the router decides it from the client's API key alone (`key_tenant` of
the key, or the tenant its policy names the key's holder) and names it to D's
sidecar in ``X-Kvferry-Tenant`` (absent: the daemon's default tenant). A sidecar
takes a request the router sent (it carries ``X-Kvferry-Turn-Id``) by that
header alone, whatever header it is configured to read for other front doors
(`tapped_tenant`): the two cannot disagree.

A conversation's end: a client sends ``X-Conversation-End: true`` with its last turn
(`conversation_ends`); the router then tells D's sidecar in ``X-Kvferry-Conversation-End``,
and the sidecar has D free the answer's blocks at once instead of registering them.

Every ``X-Kvferry-*`` request header is kvferry's own (`internal_header`): a
front door drops those a client sent before anything reads them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvferry.ids import MAX_ID_BYTES

CONVERSATION_HEADER = "X-Conversation-Id"
"""Names the conversation (a client's, and the router's to D's sidecar)."""
SESSION_HEADER = "X-Session-ID"
"""Names the conversation too (vLLM's multi-turn benchmark), after the body's field."""
TENANT_HEADER = "X-Kvferry-Tenant"
"""Set by the router on a decode request whose retention D's sidecar registers: the
turn's tenant (absent: the daemon's default tenant)."""
TURN_ID_HEADER = "X-Kvferry-Turn-Id"
"""Set by the router on every engine request: its own id of the turn, unique. D's sidecar
registers it with the retention, so that the turn's own lookup, should it reach the daemon
only after that, leaves it alone. (X-Request-Id carries the client's id when it sent one:
vLLM names its answer after it.)"""
NO_RETENTION_HEADER = "X-Kvferry-No-Retention"
"""Set by the router on a decode request nothing should be retained of (several answers,
non-text content): D's sidecar captures nothing, even when the body names a session."""
CONVERSATION_END_HEADER = "X-Conversation-End"
"""Sent by a client with a conversation's last turn ("true"): nothing of it is retained."""
END_HEADER = "X-Kvferry-Conversation-End"
"""Set by the router on the decode request of a conversation's last turn: D's sidecar has
D free the answer's blocks at once instead of registering a retention of them."""
NOT_DELIVERED_HEADER = "X-Kvferry-Not-Delivered"
"""Set on a sidecar's 502 when its engine was never reached: the request was not seen, so
the router may send it to another node as if the sidecar itself had been unreachable."""

INTERNAL_PREFIX = "x-kvferry-"
"""Starts (case aside) every header kvferry's own parts set between themselves."""

KEY_TENANT_PREFIX = "key-"
"""Starts the name of every tenant named after an API key (`key_tenant`)."""
_DIGEST_CHARS = 32
"""Hex characters of an id's digest (`safe_id`)."""


def internal_header(name: str) -> bool:
    """Whether `name` is one of kvferry's own headers (``X-Kvferry-*``), which no client
    may set: a front door drops those a client sent."""
    return name.lower().startswith(INTERNAL_PREFIX)


def _unprintable(c: str) -> bool:
    # Control characters, and the surrogates aiohttp decodes a header's non-UTF-8 bytes to
    # (surrogateescape): protobuf refuses to send those.
    return ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF


def safe_id(value: str, kind: str, digest: bool = False) -> str:
    """`value` as the daemon accepts it: itself, or (`digest`, or when too long or
    unprintable) a digest of it named ``<kind>-<hex>``."""
    raw = value.encode(errors="surrogatepass")
    if not digest and len(raw) <= MAX_ID_BYTES and not any(map(_unprintable, value)):
        return value
    return f"{kind}-{hashlib.sha256(raw).hexdigest()[:_DIGEST_CHARS]}"


def _id_value(value: object) -> str:
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return ""


def conversation_of(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """The conversation a request names, made safe ("" = none)."""
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


def conversation_ends(headers: Mapping[str, str]) -> bool:
    """Whether a client's request is its conversation's last turn (``X-Conversation-End``
    says true, 1 or yes, case aside)."""
    return headers.get(CONVERSATION_END_HEADER, "").strip().lower() in ("true", "1", "yes")


def ends_here(headers: Mapping[str, str]) -> bool:
    """Whether a request the router sent D is its conversation's last turn."""
    return TURN_ID_HEADER in headers and END_HEADER in headers


def key_tenant(key: str) -> str:
    """The tenant an API key names: a digest of it, never the key itself."""
    raw = key.encode(errors="surrogatepass")
    return KEY_TENANT_PREFIX + hashlib.blake2b(raw, digest_size=12, person=b"kvferry-tenant").hexdigest()


def named_tenant(headers: Mapping[str, str], header: str) -> str:
    """The tenant `header` names, made safe ("" = the default tenant). A name like a key's
    tenant is taken as a digest of itself: a client cannot name another's key tenant."""
    named = headers.get(header, "").strip()
    return safe_id(named, "tenant", digest=named.startswith(KEY_TENANT_PREFIX)) if named else ""


def tapped_tenant(headers: Mapping[str, str], client_header: str) -> str:
    """The tenant of a request to D's sidecar ("" = the default tenant): the router's
    (`TENANT_HEADER`) on a request the router sent, else the one `client_header` names
    (a front door of another kind; "" = none is read)."""
    if TURN_ID_HEADER in headers:
        return safe_id(headers.get(TENANT_HEADER, "").strip(), "tenant")
    return named_tenant(headers, client_header) if client_header else ""
